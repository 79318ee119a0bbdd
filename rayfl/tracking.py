"""MLflow tracking as a loop callback: the only place in rayfl that calls MLflow during a run.

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
(:class:`rayfl.tracking_outbox.Sender`) sends them, and waits out a tracking server that stops answering with
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

import csv
import dataclasses
import itertools
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Callable

import numpy as np
import yaml

from rayfl import privacy
from rayfl.config import UserError
from rayfl.loop import Callback

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
CLIENT_PREFIX = "client/"  # per-client metrics: client/<id>/test_acc
WRITER_NICER = 4  # the writer thread's niceness above its process's (Ray's workers run at 15)
METRICS_EVERY = 1.0  # seconds: the most a metric waits for its batch to be sent to the store
# The run page's model-metrics tab lays its charts out by metric key (MLflow 3.17, RunsChartsCardConfig
# .getBaseChartAndSectionConfigs: a key's section is what comes before its last "/", sections in alphabetical
# order before the unprefixed "Model metrics" one, charts sorted by key within a section; the layout a user
# makes is kept in the browser, none can be saved with a run). The three headline curves are therefore also
# logged as "accuracy/test mean", "accuracy/test worst", "accuracy/test worst 10pct" (the bottom-10% mean;
# "loss/..." for regression): a section that sorts before "client/<id>" and "setup", charts in that order,
# so the tab opens on them, timings and diagnostics below.
HEADLINE = {"mean": "test mean", "worst": "test worst", "bottom10_mean": "test worst 10pct"}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The round's test accuracy (loss for regression) mean, worst client and bottom-10% mean under the
    names the run page shows first."""
    kind = "acc" if "test_acc_mean" in metrics else "loss"
    section = "accuracy" if kind == "acc" else "loss"
    return {f"{section}/{name}": metrics[f"test_{kind}_{stat}"] for stat, name in HEADLINE.items()
            if f"test_{kind}_{stat}" in metrics}


def _with_headline(metrics: dict[str, float]) -> dict[str, float]:
    """The headline first, then test and validation summaries, then the rest: the run's Overview lists its
    metrics in the order they were first logged."""
    first = {k: v for k, v in metrics.items() if k.startswith(("test_", "val_"))}
    return {**headline(metrics), **dict(sorted(first.items(), key=lambda kv: not kv[0].startswith("test_"))),
            **metrics}


def pick_rounds(total: int, k: int = 5) -> list[int]:
    """``k`` rounds spread over 1..total, the first and the last among them: those a round-by-round matrix
    is drawn at."""
    return sorted({int(round(x)) for x in np.linspace(1, total, min(k, total))}) if total > 0 else []


def _partition_report(prepared, given: dict | None):
    from rayfl.data.report import PartitionReport

    return PartitionReport.from_dict(given) if given else PartitionReport.of(prepared)


def client_table(per_client: dict[int, dict], info):
    """A row per client: its results first (test, then validation, then any other split's accuracy and loss),
    then split sizes, then its group where the partition has groups, then the rest."""
    import pandas as pd

    rows = [{"client": c, **rec, "n_train": info.n_train[c], **({"group": info.groups[c]} if info.groups else {})}
            for c, rec in sorted(per_client.items())]
    df = pd.DataFrame(rows)
    cols = list(df.columns)
    results = [c for split in ("test", "val") for c in (f"{split}_acc", f"{split}_loss") if c in cols]
    results += [c for c in cols if c.endswith(("_acc", "_loss")) and c not in results]
    sizes = ["n_train", *(c for c in cols if c.startswith("n_") and c != "n_train")]
    first = ["client", *results, *sizes, *(["group"] if "group" in cols else [])]
    return df[first + [c for c in cols if c not in first]]


def rounds_table(history: list[dict]):
    """A row per round, numbered from 1 as on the console and in MLflow's steps."""
    import pandas as pd

    df = pd.DataFrame(history)
    if "step" in df:
        df.insert(0, "round", df.pop("step") + 1)
    return df


def final_summary(final: dict) -> dict:
    """The final round's metrics, naming the round (from 1) and its stage."""
    out = {"round": int(final["step"]) + 1} if "step" in final else {}
    if "stage" in final:
        out["stage"] = final["stage"]
    return {**out, **{k: v for k, v in numeric(final, finite_only=False).items() if k != "step"}}


def setting(cfg, final: dict | None = None) -> str:
    """What ran, in one line (rayfl.provenance.describe), with the ε a private run reached."""
    from rayfl.provenance import describe

    return describe(cfg) + privacy.describe(cfg, final)


def summary_markdown(cfg, final: dict, total: int, report=None, setting: str = "") -> str:
    """The run's description, what its Overview shows of it before "Show more": the final round's mean, worst
    client and bottom 10% as a table (first, so that it is not folded away), then the setting and the
    partition report. MLflow draws the table without cell padding: the header cells carry an em space."""
    where = f"final round {int(final['step']) + 1} of {total}" if "step" in final else "final round"
    stage = f" ({final['stage']})" if final.get("stage") else ""
    lines = [f"| {where}{stage} &emsp; | mean &emsp; | worst client &emsp; | bottom 10% &emsp; |", "|---|---|---|---|"]
    for split, name in (("test", "test"), ("val", "validation")):
        for kind, what in (("acc", "accuracy"), ("loss", "loss")):
            if f"{split}_{kind}_mean" in final and (kind == "acc" or "test_acc_mean" not in final):
                values = [final.get(f"{split}_{kind}_{s}", float("nan")) for s in ("mean", "worst", "bottom10_mean")]
                shown = [f"{v:.2%}" if kind == "acc" else f"{v:.4f}" for v in values]
                shown = [f"**{v}**" for v in shown] if split == "test" else shown
                lines.append(f"| {name} {what} | " + " | ".join(shown) + " |")
    lines += ["", setting or cfg.algo]
    if report is not None:
        lines += ["", f"Partition: {report.line()}."]
        warning = report.warning()
        if warning:
            lines += ["", f"**Warning:** {warning}."]
    return "\n".join(lines) + "\n"


def resolve_tracking_uri(uri: str | None) -> str:
    """The flag, else MLFLOW_TRACKING_URI, else a local sqlite file; local paths made absolute
    so that actors whose working directory differs write to the same store."""
    if not uri and os.environ.get("MLFLOW_TRACKING_URI"):  # checked as the flag is, named as what it is
        from rayfl.config import check_tracking_uri
        from rayfl.user_input import UserError

        uri = os.environ["MLFLOW_TRACKING_URI"]
        try:
            check_tracking_uri(uri)
        except UserError as e:
            raise UserError(f"$MLFLOW_TRACKING_URI: {e}") from None
    uri = uri or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    elif ":" not in uri and uri not in ("databricks", "databricks-uc", "uc"):  # a plain path: a file store
        uri = os.path.abspath(os.path.expanduser(uri))
    return uri


def store_error(uri: str, experiment: str, e: Exception) -> str:
    """A tracking store that cannot be opened, in one line."""
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"tracking_uri={uri!r}: cannot open experiment {experiment!r} there ({type(e).__name__}: {detail[:200]})"


def ensure_experiment(uri: str, name: str) -> str:
    """Experiment id for ``name``, created if missing, with a sqlite store's artifacts beside its database."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_root(uri))


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: ``mlruns`` beside the database file.
    MLflow's default, ``./mlruns``, is resolved against the working directory of whichever process creates
    the experiment, which on a cluster is a Ray worker's. None: the store's own default (a server's)."""
    if uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])), "mlruns")
    return None


def numeric(metrics: dict, finite_only: bool = True) -> dict[str, float]:
    """The plain numbers of a metrics dict; NaN and infinities are kept only when ``finite_only`` is off
    (MLflow stores them, and a diverged run should show as one)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
            and (not finite_only or math.isfinite(float(v)))}


def write_client_table(path: str, round_no: int, per_client: dict[int, dict]) -> None:
    """A round's per-client records as CSV, a row per client and a column per key (empty where a record has
    none, or NaN), reading back as pandas' to_csv of the same records does. At 1,000 clients this runs every
    round in the driver's process: the numbers are formatted by Arrow's C++ writer, which releases the GIL
    (the csv module held it about 3 ms a round, and the loop's thread waited), and by the csv module when a
    column holds anything else."""
    cids = sorted(per_client)
    records = [per_client[c] for c in cids]
    keys = list(dict.fromkeys(itertools.chain.from_iterable(records)))  # first seen first
    rows = [[round_no] * len(cids), cids, *(list(map(dict.get, records, itertools.repeat(k))) for k in keys)]
    table = _numbers_table(rows)
    with open(path, "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["round", "client", *keys])
        if table is None:
            out.writerows(zip(*([None if v is None or v != v else v for v in column]  # v != v: NaN
                                for column in rows)))
    if table is not None:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        with pa.OSFile(path, "ab") as sink:
            pcsv.write_csv(table, sink, write_options=pcsv.WriteOptions(include_header=False, quoting_style="none"))


def _numbers_table(columns: list[list]):
    """``columns`` as an Arrow table that its CSV writer writes as pandas would, or None unless every column
    holds only numbers and None."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:  # MLflow brings pyarrow; without it, the csv module writes the table
        return None
    arrays = []
    for column in columns:
        try:
            array = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # numbers mixed with other things
            return None
        if pa.types.is_floating(array.type):  # a float32 as numpy writes it; NaN empty
            values = array.to_numpy(zero_copy_only=False)
            nan = np.isnan(values)
            if nan.any():
                array = pc.if_else(pc.is_nan(array), None, array)
            values = values[~nan]
            if values.size and (np.floor(values) == values).all():  # Arrow writes 1.0 as 1: pandas would read
                text = pc.cast(array, pa.string())  # integers back (a column with a 0.5 in it reads as floats)
                bare = pc.match_substring_regex(text, r"^-?[0-9]+$")
                array = pc.if_else(bare, pc.binary_join_element_wise(text, ".0", ""), text)
        elif not (pa.types.is_integer(array.type) or pa.types.is_null(array.type)):
            return None  # booleans (Arrow writes true, not True)
        arrays.append(array)
    return pa.table(arrays, names=[str(i) for i in range(len(arrays))])


def yield_cpu() -> None:
    """The calling thread WRITER_NICER below its process (Linux sets niceness per thread): it takes the CPU
    that the rounds' threads and processes leave."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICER))
    except (AttributeError, OSError):
        pass


class Writer:
    """One background thread that runs logging jobs in order; ``flush`` waits for all of them and re-raises
    the first error, so a failing store is reported instead of silently dropping values. ``idle`` runs
    whenever no job came for ``every`` seconds, and before a flush completes (sending what jobs batched)."""

    def __init__(self, idle: Callable[[], None] = lambda: None, every: float = 1.0):
        self.cpu_seconds = 0.0  # CPU time this thread has spent on jobs: what tracking costs the run
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._reported = False
        self._idle, self._every = idle, every
        self._thread = threading.Thread(target=self._work, name="rayfl-mlflow-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._every)
            except queue.Empty:
                self._run(self._idle)
                continue
            try:
                if job is None:
                    return
                self._run(job)
            finally:
                self._jobs.task_done()

    def _run(self, job: Callable[[], None]) -> None:
        if self._error is None:
            t0 = time.thread_time()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - kept (every later job skipped) and raised once
                self._error = e
            self.cpu_seconds += time.thread_time() - t0

    def check(self) -> None:
        """Raise the first error of a job, once, without waiting for the queue."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def flush(self) -> None:
        self._jobs.put(self._idle)
        self._jobs.join()
        self.check()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class MlflowTracker(Callback):
    def __init__(self, tracking_uri: str, experiment_id: str | None = None, run_name: str | None = None,
                 parent_run_id: str | None = None, extra_params: dict | None = None, tags: dict | None = None,
                 run_id: str | None = None, experiment: str | None = None, partition: dict | None = None):
        """``experiment_id``, or ``experiment``: a name, the experiment opened (created if missing) by the
        writer; ``tags``: the submitting process's provenance (rayfl.provenance.origin) and the sweep's own;
        ``run_id``: an MLflow run to reopen and go on with (a driver restarted after its predecessor died);
        ``partition``: the submitter's :class:`rayfl.data.report.PartitionReport` as a dict (a Ray driver's
        dataset has no labels to count; without it the report holds split sizes only)."""
        self.uri = tracking_uri
        self.tags = tags or {}
        self.experiment_id, self.experiment = experiment_id, experiment
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.extra_params = extra_params or {}
        self.run_id: str | None = None
        self.reopen = run_id
        self.client_metrics = False
        self.writer: Writer | None = None
        self.sender = None  # rayfl.tracking_outbox.Sender, once the run exists
        self.outbox = None  # rayfl.tracking_outbox.Outbox in the run directory
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
        from rayfl.tracking_outbox import Outbox, Sender, outbox_dir

        self.open()
        self.algo = loop.cfg.algo
        self.wait = float(getattr(loop.cfg, "tracking_wait", self.wait))
        self.client_metrics = loop.cfg.clients <= loop.cfg.client_metrics
        if loop.checkpoint_dir:
            root = loop.checkpoint_dir
        else:
            root = self._scratch = tempfile.mkdtemp(prefix="rayfl-mlflow-")
        self.outbox = Outbox(outbox_dir(root))
        resume_file = os.path.join(loop.checkpoint_dir, "mlflow_run_id") if loop.checkpoint_dir else None
        resumed = bool(loop.start_step > 0 and resume_file and os.path.isfile(resume_file))
        reopen = self.reopen or (open(resume_file).read().strip() if resumed else None)
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
                                 for k, v in _with_headline(numeric(h, finite_only=False)).items() if k != "step"])
                self._log_tags({"rayfl.stage_reused": reuse[0], "rayfl.stage_key": reuse[1]})
            self._send_metrics()
            if resume_file:
                os.makedirs(loop.checkpoint_dir, exist_ok=True)
                with open(resume_file, "w") as f:
                    f.write(self.run_id)

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
        metrics = {**_with_headline(numeric(record.metrics, finite_only=False)),
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
        from rayfl.tracking_outbox import server_address, sync

        error = None
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


def close_run(uri: str, run_id: str, status: str) -> None:
    """End an MLflow run that its driver could not end (killed in a round), if the store answers within a few
    seconds and the run is still RUNNING; what it holds is kept."""
    from mlflow.tracking import MlflowClient

    from rayfl.tracking_outbox import answers, server_address

    if not answers(server_address(uri), timeout=3.0):
        return
    try:
        client = MlflowClient(uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001 - best effort on the way out of an interrupted run
        pass
