"""MLflow tracking as a loop callback: what a run logs, and when.

One MLflow run per experiment (a child of a sweep's parent run under Tune): every resolved config value
as a param, per-round summary metrics with ``step=round``, per-client values as one table artifact per
evaluated round (``results/clients/round_NNNN.csv``; also as metrics ``client/<id>/<name>`` for
federations of at most ``client_metrics`` clients, off by default: MLflow 3 shows every prefixed section
of a run's charts before the unprefixed summary), and artifacts (config, placement, per-client results,
round history, the final summary as ``results/final.json`` (the last point of every series, not a second
set of one-point charts), final weights, plots, and whatever the algorithm keeps, such as FedFomo's P).

Everything, from importing MLflow and opening the store and the experiment to creating the run, is done by
one background thread (:class:`Writer`): a driver starts it while its client actors start, the run exists
before the first round, and no round waits on the tracking store after that. The writer turns each round into
records (metrics, and files written straight into the run directory's outbox); a second thread
(:class:`rayfl.tracking.outbox.Sender`) sends them, and waits out a tracking server that stops answering with
the records kept. Rounds shorter than a second share one call to the store for their metrics and one for their
files; what the two threads cost is logged with each round (``tracking_cpu_seconds``: their CPU time since the
round before, which holds the batches sent so far) and for all rounds (the tag ``rayfl.tracking_cpu_seconds``,
the last batch included; after a driver restart, the rounds of the driver that ended the run). The run is
closed only after every record is sent, when the run ends and when it fails, waiting at most ``tracking_wait``
seconds for an away server; what is left then stays in the outbox for ``rayfl sync``. A store that rejects
what it is sent ends the run at the next round; a checkpoint makes what was reported durable (sent, or kept
in the outbox); a reopened run (a restarted driver, a resume) does not log a round its MLflow run holds; a
process killed outright loses the metrics it had not sent, not its files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Callable

import numpy as np
import yaml

from rayfl import privacy
from rayfl.config import UserError
from rayfl.loop import Callback
from rayfl.tracking.store import ensure_experiment, store_error
from rayfl.tracking.tables import (CLIENT_PREFIX, _with_headline, client_table, final_summary, numeric, pick_rounds,
                                   rounds_table, setting, summary_markdown, write_client_table)
from rayfl.tracking.writer import Writer, yield_cpu

METRICS_EVERY = 1.0  # seconds: the most a metric waits for its batch to be sent to the store


def _partition_report(prepared, given: dict | None):
    from rayfl.data.report import PartitionReport

    return PartitionReport.from_dict(given) if given else PartitionReport.of(prepared)


class MlflowTracker(Callback):
    def __init__(self, tracking_uri: str, experiment_id: str | None = None, run_name: str | None = None,
                 parent_run_id: str | None = None, extra_params: dict | None = None, tags: dict | None = None,
                 run_id: str | None = None, experiment: str | None = None, partition: dict | None = None,
                 selection: str | None = None):
        """``experiment_id``, or ``experiment``: a name, the experiment opened (created if missing) by the
        writer; ``tags``: the submitting process's provenance (rayfl.provenance.origin) and the sweep's own;
        ``run_id``: an MLflow run to reopen and go on with (a driver restarted after its predecessor died, a run
        resumed from its checkpoint: its submitter says which); ``on_run`` (an attribute) is told the run's id
        once the run exists, before its first round;
        ``partition``: the submitter's :class:`rayfl.data.report.PartitionReport` as a dict (a Ray driver's
        dataset has no labels to count; without it the report holds split sizes only);
        ``selection``: the metric a sweep selects its trials on, also logged as ``Selection/<metric>`` (first in
        MLflow's lists: rayfl.tracking.tables.SELECTION_PREFIX)."""
        self.uri = tracking_uri
        self.tags = tags or {}
        self.experiment_id, self.experiment = experiment_id, experiment
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.extra_params = extra_params or {}
        self.run_id: str | None = None
        self.reopen = run_id
        self.on_run: Callable[[str], None] = lambda run_id: None  # told the run's id once it exists
        self.client_metrics = False
        self.writer: Writer | None = None
        self.sender = None  # rayfl.tracking.outbox.Sender, once the run exists
        self.outbox = None  # rayfl.tracking.outbox.Outbox in the run directory
        self.wait = 300.0  # tracking_wait: the most the run's end waits for a server that does not answer
        self.unsent: str | None = None  # the outbox directory, when the run ended with records not sent
        self._pending: list = []  # metrics waiting for the writer's next batch
        self._files: str | None = None  # the outbox's files tree that the next batch takes
        self._logged_upto = 0  # a reopened run: the last round its MLflow run (or outbox) already holds
        self._setup_logged = False
        self._sent = 0.0
        self._cpu_mark = 0.0  # the writer's and sender's cpu_seconds when the last round's metrics were made
        self._cpu_start = 0.0  # ... when the first round began
        self.algo = ""
        self.partition = partition
        self.selection = selection
        self.system_interval = 0.0  # system_metrics_interval: seconds between MLflow's system metrics; 0: off
        self.system = None  # rayfl.tracking.system.SystemMetrics, once the run exists
        self.report = None  # the run's PartitionReport, made when it starts
        self.kept: dict[str, dict[int, np.ndarray]] = {}  # square round artifacts at a few rounds, for one figure
        self.warnings: list[str] = []  # the algorithm's caveats so far (Server.warnings): the tag rayfl.warnings
        self._keep_rounds: set[int] = set()
        self._client = None
        self._scratch: str | None = None  # a run without a run directory (compare's children): a private one

    # --- writing, in the background -------------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> None:
        self.writer.submit(job)

    def _cpu(self) -> float:
        """CPU time the writer and the sender have spent: what tracking costs the run."""
        return self.writer.cpu_seconds + (self.sender.cpu_seconds if self.sender is not None else 0.0)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queued for the next batch: a call to the store costs about as much as 60 values in it, so rounds
        shorter than ``METRICS_EVERY`` share one call (sent then, when the writer is idle, and on flush)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, v, now, step) for k, v in metrics.items())
        if len(self._pending) >= 1000 or time.monotonic() - self._sent >= METRICS_EVERY:
            self._send_metrics()

    def _send_metrics(self) -> None:
        """The metrics and the files queued for the next batch, handed to the sender: one call for the
        metrics, one for the files (a round's files: one call a second instead of one a file)."""
        items, self._pending = self._pending, []
        self._sent = time.monotonic()
        if items:
            self._log_items(items)
        if self._files is not None:
            self.sender.put(("files", self._files))
            self._files = None

    def _log_items(self, items: list) -> None:
        self.sender.put(("metrics", items))

    def _system_sample(self, metrics: dict[str, float], step: int) -> None:
        """A sample of MLflow's system metrics (the sampling thread's), queued for the writer's next batch."""
        writer = self.writer
        if writer is not None:
            writer.submit(lambda: self._log_metrics(metrics, step))

    def _log_tags(self, tags: dict[str, str]) -> None:
        self.sender.put(("tags", [(k, str(v)) for k, v in tags.items()]))

    def _log_file(self, name: str, write: Callable[[str], None], artifact_path: str) -> None:
        """``write(path)`` makes the file, in the outbox's files tree under ``artifact_path``; it goes to the
        store with the next batch of metrics, the batch's files in one call."""
        if self._files is None:
            self._files = self.outbox.new_files()
        folder = os.path.join(self.outbox.files, self._files, artifact_path)
        os.makedirs(folder, exist_ok=True)
        write(os.path.join(folder, name))

    def _log_array(self, name: str, array, artifact_path: str) -> None:
        self._log_file(name, lambda p: np.save(p, np.asarray(array)), artifact_path)

    def _log_dict(self, obj: dict, artifact_file: str) -> None:
        """As MLflow's log_dict writes a .json file."""
        import json

        folder, name = os.path.split(artifact_file)

        def write(p):
            with open(p, "w") as f:
                json.dump(obj, f, indent=2, default=str)

        self._log_file(name, write, folder)

    def _log_text(self, text: str, artifact_file: str) -> None:
        folder, name = os.path.split(artifact_file)

        def write(p):
            with open(p, "w") as f:
                f.write(text)

        self._log_file(name, write, folder)

    def _log_figure(self, fig, artifact_file: str) -> None:
        folder, name = os.path.split(artifact_file)
        self._log_file(name, fig.savefig, folder)

    def _log_object(self, name: str, obj, path: str) -> None:
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            self._log_file(f"{name}.csv", lambda p: obj.to_csv(p, index=False), path)
        elif isinstance(obj, dict):
            self._log_dict(obj, f"{path}/{name}.json")
        elif hasattr(obj, "savefig"):
            self._log_figure(obj, f"{path}/{name}.png")
        else:
            self._log_array(f"{name}.npy", obj, path)
            arr = np.asarray(obj)
            if arr.ndim == 2 and arr.shape[0] == arr.shape[1] and arr.shape[0] > 1:
                from rayfl.plots import matrix_plot

                self._log_figure(matrix_plot(self.algo, name, arr), f"plots/{name}.png")

    def open(self) -> None:
        """Start the writer and have it import MLflow, open the store and the experiment (2-4 s of one core
        with a SQLite store) while this process does other work: a driver calls it while its client actors
        start. Then the writer yields the CPU to the rounds."""
        if self.writer is None:
            self.writer = Writer(idle=lambda: self._send_metrics() if self.sender is not None else None,
                                 every=METRICS_EVERY)
            self._submit(self._connect)

    def _connect(self) -> None:
        from mlflow.tracking import MlflowClient

        try:
            self._client = MlflowClient(self.uri)
            self.experiment_id = self.experiment_id or ensure_experiment(self.uri, self.experiment)
            self._client.get_experiment(self.experiment_id)  # a given id must exist
        except Exception as e:  # noqa: BLE001 - MLflow's errors for a bad store vary (sqlite, http, paths)
            raise UserError(store_error(self.uri, self.experiment or self.experiment_id, e)) from None
        yield_cpu()

    def _already_logged(self, run_id: str) -> None:
        """A reopened run (a driver restarted, a run resumed): the last round it holds, in MLflow or in the
        outbox, and whether its setup was logged; those are not logged a second time."""
        steps = [m.step for m in self._client.get_metric_history(run_id, "participants")]
        setup = any(k.startswith("setup/") for k in self._client.get_run(run_id).data.metrics)
        unsent = self.outbox.unsent()["metrics"]
        steps += [s for k, s, _, _ in unsent if k == "participants"]
        self._logged_upto = max(steps, default=0)
        self._setup_logged = setup or any(k.startswith("setup/") for k, *_ in unsent)

    # --- callback hooks -------------------------------------------------------------------------
    def on_start(self, loop) -> None:
        """The run is created (or reopened) by the writer, and exists before the first round: MLflow's imports
        and store would otherwise slow the first rounds, and a store that cannot be opened ends the run here."""
        from rayfl.provenance import run_tags
        from rayfl.tracking.outbox import Outbox, Sender, outbox_dir

        self.open()
        self.algo = loop.cfg.algo
        self.wait = float(getattr(loop.cfg, "tracking_wait", self.wait))
        self.system_interval = float(getattr(loop.cfg, "system_metrics_interval", self.system_interval))
        self.client_metrics = loop.cfg.clients <= loop.cfg.client_metrics
        if loop.checkpoint_dir:
            root = loop.checkpoint_dir
        else:
            root = self._scratch = tempfile.mkdtemp(prefix="rayfl-mlflow-")
        self.outbox = Outbox(outbox_dir(root))
        reopen = self.reopen
        cfg, info = loop.cfg, loop.prepared.info
        placement = loop.runtime.placement()
        params = {**cfg.to_flat(), "model_resolved": loop.prepared.model_spec.name, "n_params": info.n_params,
                  "n_actors": len(placement), **self.extra_params}
        tags = run_tags(cfg, self.tags)
        if privacy.DPSettings.from_config(cfg) is not None:  # tagged, and the description says so
            tags.update(privacy.run_tags(cfg))
            tags["mlflow.note.content"] += privacy.describe(cfg)
        run_name = privacy.run_name(self.run_name, cfg)
        reuse = loop.stage_reuse.reused if loop.stage_reuse and not reopen else None
        reused = [dict(h) for h in loop.history] if reuse else []
        report = self.report = _partition_report(loop.prepared, self.partition)
        self._keep_rounds = set(pick_rounds(len(loop.schedule())))

        def begin():
            import json

            import pandas as pd
            from mlflow.entities import Metric
            from mlflow.tracking.context.registry import resolve_tags

            from rayfl.plots import partition_plot

            client = self._client
            if reopen:
                self.run_id = reopen
                client.update_run(reopen, status="RUNNING")
                self._already_logged(reopen)
                if loop.step_size_changes:  # its params say the first values; this, what the later rounds used
                    from rayfl.resume import step_size_note

                    client.set_tag(reopen, "rayfl.step_sizes", step_size_note(loop.step_size_changes))
            else:
                parent = {"mlflow.parentRunId": self.parent_run_id} if self.parent_run_id else {}
                table = {"mlflow.loggedArtifacts": json.dumps([{"path": "results/clients.json", "type": "table"}])}
                self.run_id = client.create_run(self.experiment_id, run_name=run_name,
                                                tags=resolve_tags({**tags, **parent, **table})).info.run_id
            self.outbox.write_run(run_id=self.run_id, tracking_uri=self.uri, experiment_id=self.experiment_id,
                                  status=None, end_time=None)
            self.sender = Sender(client, self.run_id, self.uri, self.outbox, on_start=yield_cpu)
            if self.system_interval > 0:  # sampled on a thread of its own, logged by the writer with the rounds
                from rayfl.tracking.system import SystemMetrics

                self.system = SystemMetrics(self.run_id, self.uri, self.system_interval, self._system_sample)
                self.system.start()
            if not reopen:
                self.sender.put(("params", [(k, str("" if v is None else v)) for k, v in params.items()]))
                self._log_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), "config.yaml")
                self._log_dict({"placement": placement}, "placement.json")
                clients = pd.DataFrame({"client": range(cfg.clients), "n_train": info.n_train,
                                        "group": info.groups or [None] * cfg.clients})
                self._log_file("clients.json", lambda p: clients.to_json(p, orient="split", index=False,
                                                                          date_format="iso"), "results")
                self._log_object("partition", report.table(), "results")
                if report.counts is not None:
                    title = f"training labels per client: {setting(cfg)}"
                    self._log_figure(partition_plot(report.counts, title), "plots/partition.png")
            if reuse:  # a stored stage (rayfl.stage_cache): its rounds, as if they had run here
                now = int(time.time() * 1000)
                self._log_items([Metric(k, v, now, h["step"] + 1) for h in reused
                                 for k, v in _with_headline(numeric(h, finite_only=False), self.selection).items()
                                 if k != "step"])
                self._log_tags({"rayfl.stage_reused": reuse[0], "rayfl.stage_key": reuse[1]})
            self._send_metrics()
            self.on_run(self.run_id)  # before the first round: whoever submitted the run learns its id

        self._submit(begin)
        self.writer.flush()
        self._cpu_mark = self._cpu_start = self._cpu()  # start-up is not charged to the rounds

    def on_setup(self, loop) -> None:
        if loop.setup_metrics and not self._setup_logged:
            metrics = {f"setup/{k}": v for k, v in numeric(loop.setup_metrics, finite_only=False).items()}
            self._submit(lambda: self._log_metrics(metrics, 0))

    def on_round(self, loop, record) -> None:
        self.writer.check()  # a store that failed ends the run now, not after its last round
        self.sender.check()
        step, per_client = record.step, record.per_client
        if step + 1 <= self._logged_upto:  # replayed after a driver restart: the run holds this round already
            return
        metrics = {**_with_headline(numeric(record.metrics, finite_only=False), self.selection),
                   "participants": float(len(record.participants))}
        if record.warnings:  # the algorithm's caveats stay with the run: a tag a runs table can show
            self.warnings += record.warnings
            shown = "; ".join(self.warnings)
            self._submit(lambda: self._log_tags({"rayfl.warnings": shown}))
        arrays = record.artifacts
        if step + 1 in self._keep_rounds:  # a few rounds of each square matrix, drawn side by side at the end
            for name, arr in arrays.items():
                if np.ndim(arr) == 2 and np.shape(arr)[0] == np.shape(arr)[1] > 1:
                    self.kept.setdefault(name, {})[step + 1] = arr

        def job():
            # the writer's CPU since the previous round's job began (that job and the batches sent since)
            cpu = self._cpu()
            values = {**metrics, "tracking_cpu_seconds": cpu - self._cpu_mark}
            self._cpu_mark = cpu
            if per_client:
                self._log_file(f"round_{step + 1:04d}.csv", lambda p: write_client_table(p, step + 1, per_client),
                               "results/clients")
                if self.client_metrics:
                    for cid, rec in per_client.items():
                        for k, v in numeric(rec, finite_only=False).items():
                            if not k.startswith("n_") and k != "seconds":
                                values[f"{CLIENT_PREFIX}{cid}/{k}"] = v
            self._log_metrics(values, step + 1)  # rounds from 1, as on the console; setup is step 0
            for name, arr in arrays.items():
                self._log_array(f"{name}_{step + 1:04d}.npy", arr, f"rounds/{name}")

        self._submit(job)

    def on_recover(self, loop, event) -> None:
        """Client actors died and were restarted: a tag with the count so far, and a metric at the round."""
        n, step = event["restarts"], event["step"]

        def job():
            self._log_tags({"rayfl.client_restarts": str(n)})
            self._log_metrics({"client_restarts": float(n)}, step)

        self._submit(job)

    def on_end(self, loop) -> None:
        import pandas as pd

        from rayfl.plots import accuracy_plot, matrix_rounds

        # what the rounds cost the writer in all, their last batch included (a round's own metric cannot hold
        # the batches sent after it), the end-of-run artifacts apart: the tag rayfl.tracking_cpu_seconds
        self.writer.flush()
        rounds_cpu = self._cpu() - self._cpu_start
        info = loop.prepared.info
        table = client_table(loop.last_eval, info) if loop.last_eval else pd.DataFrame()
        history = rounds_table(loop.history)
        cfg = loop.cfg
        title = f"{cfg.algo} on {cfg.dataset} ({cfg.clients} clients, {cfg.partition}, seed {cfg.seed})"
        final = loop.server.final_model()
        final_vec = loop.runtime.get([final])[0] if final is not None else None
        vectors = loop.runtime.client_vectors()
        artifacts = loop.server.artifacts()
        summary = numeric(loop.final, finite_only=False)  # also the last point of every series
        final_json = final_summary(loop.final)
        hist = list(loop.history)
        note = summary_markdown(cfg, loop.final, len(loop.schedule()), self.report, setting(cfg, summary))
        kept = {name: rounds for name, rounds in self.kept.items() if len(rounds) > 1}

        def job():
            self._log_object("per_client", table, "results")
            self._log_object("rounds", history, "results")
            if final_vec is not None:
                self._log_array("global.npy", final_vec, "models")
            if vectors:  # personal weights only (FedAvg's clients have none)
                self._log_file("clients.npz", lambda p: np.savez_compressed(
                    p, **{f"client_{c}": v for c, v in sorted(vectors.items())}), "models")
            self._log_figure(accuracy_plot(hist, title + privacy.plot_title(cfg, summary), cfg.clients),
                             "plots/accuracy.png")
            for name, obj in artifacts.items():
                self._log_object(name, obj, "algorithm")
            for name, rounds in kept.items():
                self._log_figure(matrix_rounds(self.algo, name, rounds), f"plots/{name}_rounds.png")
            self._log_dict(final_json, "results/final.json")
            # the Overview opens on the description: the results, the setting (with the ε a private run reached)
            self._log_tags({"mlflow.note.content": note, "rayfl.tracking_cpu_seconds": f"{rounds_cpu:.6f}",
                            **privacy.final_tags(cfg, summary)})

        self._submit(job)
        self._close("FINISHED", self.wait)

    def on_checkpoint(self, loop) -> None:
        """What was reported is durable before a checkpoint (a driver restarted from it does not log those
        rounds again): sent to the store, or, while its server does not answer, written to the outbox in the
        run directory (the round does not wait for the server)."""
        if self.writer is None or self.sender is None:
            return
        self.writer.flush()  # its last step hands the queued metrics and files to the sender
        while not self.sender.drain(0.5):
            if not self.sender.answers():  # away (or a call of the sender's stuck in MLflow's retries)
                self.sender.spill()
                break

    def _close(self, status: str, wait: float) -> None:
        """Drain the writer (raising its first error), then have the sender deliver everything and the run's
        end (``status``), waiting at most ``wait`` seconds for a tracking server that does not answer; what is
        left then stays in the outbox (``self.unsent``), for ``rayfl sync``."""
        from rayfl.tracking.outbox import server_address, sync

        error = None
        if self.system is not None:  # its last sample (the interval under way) goes with the last batch
            self.system.stop()
            self.system = None
        try:
            if self.writer is not None:
                try:
                    self.writer.flush()  # every job done, the last batch handed to the sender
                    self.writer.close()
                except BaseException as e:  # noqa: BLE001 - raised once the run's end is delivered or kept
                    error = e
            if self.sender is not None:
                self.sender.put(("status", status, int(time.time() * 1000)))
                # a local store: its errors end a finished run, however long it takes; a failing one waits so long
                bound = wait if server_address(self.uri) is not None or status != "FINISHED" else None
                drained = False
                try:
                    drained = self.sender.drain(bound)
                except BaseException as e:  # noqa: BLE001 - raised below, the run ended first
                    error = error or e
                if self.sender.failed:  # the store rejected a record: no more are sent; the run is ended as it is
                    self.sender.stop()
                    self.sender.spill()
                    try:
                        self._client.set_terminated(self.run_id, status)
                    except Exception:  # noqa: BLE001 - the error already raised is the one to show
                        pass
                elif not drained:
                    self.sender.stop()
                    self.sender.spill()
                elif self.outbox.count():  # spilled at a checkpoint while the server was away: it is back
                    try:
                        sync(os.path.dirname(self.outbox.dir))
                    except Exception:  # noqa: BLE001 - away again: they stay for rayfl sync
                        pass
                self.sender.stop()
                if self.outbox.count():
                    self.unsent = self.outbox.dir
                else:
                    shutil.rmtree(self.outbox.dir, ignore_errors=True)
        finally:
            self.writer = None
            if self._scratch and not self.unsent:
                shutil.rmtree(self._scratch, ignore_errors=True)
        if error is not None:
            raise error

    def unsent_line(self) -> str | None:
        """The one line a run that ended with records not sent prints: how many, where, how to send them."""
        if not self.unsent:
            return None
        return unsent_line(os.path.dirname(self.unsent), self.uri, self.wait)

    def fail(self, status: str = "FAILED", why: str | None = None) -> None:
        """Close the run as FAILED (or KILLED when stopped on request), keeping all logged so far (in the
        store, or in the outbox when its server does not answer within a shorter wait: a stopped run's
        submitter waits only so long). ``why``: the failure's one line, the run's description and the tag
        ``rayfl.failure``, so that its page opens on why it has no result."""
        if self.run_id is None or self.sender is None:  # the run was never created: nothing to close
            self.writer = None
            if self._scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)
            return
        if why and self.writer is not None:
            self._submit(lambda: self._log_tags({"rayfl.failure": why, "mlflow.note.content": f"**{status}**: {why}"}))
        self._close(status, min(self.wait, FAIL_WAIT))


FAIL_WAIT = 20.0  # seconds a failing or stopped run waits for an away server (the submitter's grace is 30)


def unsent_line(run_dir: str, uri: str, wait: float) -> str:
    return (f"rayfl: warning: the tracking server at {uri} did not answer within tracking_wait={wait:g} s; the "
            f"results are complete, the MLflow records not sent are kept in {os.path.join(run_dir, 'mlflow_outbox')}"
            f"; send them with: rayfl sync {run_dir}")
