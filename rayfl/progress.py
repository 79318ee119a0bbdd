"""What a run tells its user while it runs: one event dict at a time, shown by :class:`ConsoleProgress`.

Events (each a dict with an ``"event"`` key) in the order a run sends them:
``plan`` (config, run directory, the partition report), ``cluster`` (``state``: starting / ready), ``actors``
(``ready`` of ``total`` client actors constructed), ``start`` and ``setup`` (the driver's clock when the loop starts),
``round`` (one per round: the loop's record plus the driver's ``time``) and ``done``.
A round's wall time is the gap between two consecutive driver times, so evaluation, MLflow logging and
checkpoints are in it; the walls add up to the run's time. A round line also says how long the command has
taken so far (its start-up, most of a small run, counted once the first round shows it) and the time the
rounds left will take at the mean wall. Under Ray a round is reported while the clients
run the next one's training, so rounds overlap and the last round's wall can be shorter than its own
``round_seconds``. Any callable taking such a dict can stand in for the console (``rayfl.run(progress=f)``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable


@contextmanager
def stderr_into(f):
    """File descriptor 2 into the open file ``f`` for a while: what Ray's C++ code prints there (start-up
    retries, warnings) stays out of the console."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def format_round(rec: dict, wall: float | None = None, eta: float | None = None,
                 elapsed: float | None = None, epsilon: float | None = None) -> str:
    """One line per round: the summary across clients, the round's wall time, the time since the command
    started (its start-up counted), the time the rounds left will take and, in a private run, the largest ε
    over clients so far (``epsilon``: the last one evaluated when this round was not)."""
    m = rec["metrics"]
    parts = [f"round {rec['step'] + 1:>3}/{rec['total']} [{rec['stage']}]"]
    if "test_acc_mean" in m:
        parts.append(f"test acc {m['test_acc_mean']:.3f} (worst {m['test_acc_worst']:.3f})")
    elif "test_loss_mean" in m:
        parts.append(f"test loss {m['test_loss_mean']:.4f}")
    if "val_acc_mean" in m:
        parts.append(f"val acc {m['val_acc_mean']:.3f}")
    if "train_loss" in m and m["train_loss"] == m["train_loss"]:
        parts.append(f"train loss {m['train_loss']:.3f}")
    parts.append(f"{m['round_seconds'] if wall is None else wall:.2f}s")
    if elapsed is not None:
        parts.append(f"elapsed {format_seconds(elapsed)}")
    if eta is not None:
        parts.append(f"eta {format_seconds(eta)}")
    epsilon = m.get("dp_epsilon_max", epsilon)
    if epsilon is not None:
        parts.append(f"ε {epsilon:.3g}")
    return "  ".join(parts)


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class RoundClock:
    """Round wall times from the driver's timestamps, and the time the rounds left will take: nothing until
    two rounds are timed (the first carries the start of the pipeline), then each kind of round left (one
    that evaluates every client, one that does not) at the mean of its own kind, or of the other kind when
    none of its own has been timed yet."""

    def __init__(self):
        self.last: float | None = None
        self.walls: dict[bool, list[float]] = {True: [], False: []}

    def mark(self, t: float) -> None:
        """The loop (re)started or finished its setup at driver time ``t``: round 1 counts from here."""
        self.last = t

    def round(self, rec: dict) -> tuple[float | None, float | None]:
        wall = None if self.last is None else rec["time"] - self.last
        self.last = rec["time"]
        if wall is None:
            return None, None
        evaluated = rec.get("evaluated", True)
        self.walls[evaluated].append(wall)
        timed = self.walls[True] + self.walls[False]
        if len(timed) < 2:
            return wall, None
        left = rec["total"] - rec["step"] - 1
        evaluated_left = min(rec.get("evaluated_left", left), left)
        mean = {kind: sum(w) / len(w) if w else sum(timed) / len(timed) for kind, w in self.walls.items()}
        return wall, evaluated_left * mean[True] + (left - evaluated_left) * mean[False]


class ConsoleProgress:
    """Plain lines on a pipe or file (CI logs, ``ray job submit``); on a terminal the actor count is
    updated in place. ``rounds=False`` keeps the start-up lines and drops the per-round ones."""

    def __init__(self, stream=None, rounds: bool = True, tty: bool | None = None, every: float = 10.0):
        self.stream = stream or sys.stdout
        self.rounds = rounds
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = every  # seconds between repeated "actors ready" lines on a pipe
        self.clock = RoundClock()
        self.open_line = False  # a terminal line being rewritten in place
        self.actors_since: float | None = None
        self.last_actor_line = 0.0
        self.since: float | None = None  # when the command made its plan: elapsed times count its start-up
        self.epsilon: float | None = None  # a private run's largest ε so far (rounds without evaluation repeat it)
        self.tracking_uri: str | None = None  # the run's store, from its plan: where its MLflow page is
        self.ui_port: int | None = None  # the MLflow UI's port, from its plan (--ui-port)

    def __call__(self, event: dict) -> None:
        handler = getattr(self, "on_" + event["event"], None)
        if handler:
            handler(event)

    def write(self, line: str, in_place: bool = False) -> None:
        if in_place and self.tty:
            self.stream.write("\r" + line.ljust(79))
            self.open_line = True
        else:
            if self.open_line:
                self.stream.write("\n")
                self.open_line = False
            self.stream.write(line + "\n")
        self.stream.flush()

    def on_plan(self, e: dict) -> None:
        from rayfl.data.report import PartitionReport

        cfg, p = e["cfg"], e["prepared"]
        self.since = time.monotonic()
        self.tracking_uri = e.get("tracking_uri")
        self.ui_port = e.get("ui_port")
        knobs = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(p.params).items())
        from rayfl.privacy import headline

        private = headline(cfg)
        self.write(f"rayfl: {cfg.algo}{f' ({knobs})' if knobs else ''} on {cfg.dataset} ({cfg.partition}), "
                   f"{cfg.clients} clients, {p.info.n_params} parameters ({p.model_spec.name})"
                   f"{f'; {private}' if private else ''}; run directory {e['run_dir']}")
        partition(e.get("partition") or PartitionReport.of(p), self.write)

    def on_mlflow_run(self, e: dict) -> None:
        if self.tracking_uri and e.get("experiment_id"):
            self.write(f"rayfl: watch it in MLflow: "
                       f"{ui_url(self.tracking_uri, e['experiment_id'], e['run_id'], self.ui_port)}")

    def on_cluster(self, e: dict) -> None:
        if e["state"] == "starting":
            where = f"connecting to Ray at {e['address']}" if e.get("address") else "starting a local Ray instance"
            self.write(f"rayfl: {where} ...")
        elif e["state"] == "ready":
            res = e["resources"]
            logs = f"; Ray's own logs: {e['logs']}" if e.get("logs") else ""
            self.write(f"rayfl: Ray ready in {e['seconds']:.1f}s ({res.get('CPU', 0):g} CPUs, "
                       f"{res.get('GPU', 0):g} GPUs){logs}")

    def on_actors(self, e: dict) -> None:
        now = time.monotonic()
        if self.actors_since is None:
            self.actors_since = now
        line = f"rayfl: client actors ready {e['ready']}/{e['total']} ({now - self.actors_since:.0f}s)"
        if e["ready"] == e["total"]:
            self.write(line)
        elif self.tty:
            self.write(line, in_place=True)
        elif e["ready"] == 0 or now - self.last_actor_line >= self.every:
            self.write(line)
            self.last_actor_line = now

    def on_start(self, e: dict) -> None:
        self.clock.mark(e["time"])
        if e.get("start_step"):
            self.write(f"rayfl: resuming after round {e['start_step']}/{e['total']}")

    def on_setup(self, e: dict) -> None:
        self.clock.mark(e["time"])

    def on_round(self, e: dict) -> None:
        wall, eta = self.clock.round(e)
        self.epsilon = e["metrics"].get("dp_epsilon_max", self.epsilon)
        if self.rounds:
            self.write(format_round(e, wall, eta, None if self.since is None else time.monotonic() - self.since,
                                    self.epsilon))
        for warning in e.get("warnings", ()):  # the algorithm's caveats, shown with --quiet too
            self.write(f"rayfl: warning: {warning}")


def partition(report, write: Callable[[str], None] = print, prefix: str = "rayfl: ") -> None:
    """The federation in one line, and the warning its small validation or test splits call for."""
    write(f"{prefix}partition: {report.line()}")
    warning = report.warning()
    if warning:
        write(f"{prefix}warning: {warning}")


def ui_base(tracking_uri: str, port: int | None = None) -> str:
    """Where the MLflow UI is: a tracking server's own address (``port``: the UI's, when it is reached at
    another, e.g. through a tunnel), else ``mlflow ui`` on this machine at ``port`` (default 5000, its own)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return f"http://127.0.0.1:{port or 5000}"
    base = tracking_uri.rstrip("/")
    if port is None:
        return base
    import urllib.parse

    url = urllib.parse.urlparse(base)
    host = url.hostname or "127.0.0.1"
    return url._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}").geturl()


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None, port: int | None = None) -> str:
    """Where the MLflow UI (:func:`ui_base`) shows an experiment's runs table in its model-training view
    (MLflow 3 opens an experiment on its GenAI page otherwise), or one run's page."""
    page = f"runs/{run_id}" if run_id else "runs"
    return f"{ui_base(tracking_uri, port)}/#/experiments/{experiment_id}/{page}?workflowType=machine_learning"


def mlflow_hint(tracking_uri: str, experiment_id: str, run_id: str | None = None, what: str = "this run",
                port: int | None = None) -> str:
    """The closing lines: how to start the UI on this store (at ``port``: ``--ui-port``), the address that
    lands on the runs and the one of ``run_id`` (``what``: this run, this sweep, this comparison)."""
    lines = []
    if not tracking_uri.startswith(("http://", "https://")):
        lines.append(f"look at it: mlflow ui --backend-store-uri {tracking_uri}" + (f" --port {port}" if port else ""))
    lines.append(f"  then open {ui_url(tracking_uri, experiment_id, port=port)}")
    if run_id:
        lines.append(f"  {what}: {ui_url(tracking_uri, experiment_id, run_id, port)}")
    lines.append('  (if MLflow shows its GenAI overview instead, click "Model training" in the GenAI | Model training '
                 'switch at the top left)')
    return "\n".join(lines)


def summary_table(final: dict, worst_samples: int | None = None, caveat: str | None = None) -> str:
    """The closing table of a run or a sweep's best trial: each metric's summary across clients, a row each.
    The caveats travel with it: the test worst client's value is marked († and a footnote) when it rests on
    fewer than 10 test samples (``worst_samples``: :func:`rayfl.metrics.worst_client_samples`), and the
    partition's ``caveat`` (:meth:`rayfl.data.report.PartitionReport.warning`) follows it."""
    from rayfl.metrics import FEW_SAMPLES_MARK, few_samples, few_samples_note

    extra = sorted(k[:-5] for k in final if k.endswith("_acc_mean") and k[:-5] not in ("test_acc", "val_acc"))
    metrics = [m for m in ("test_acc", "val_acc", "test_loss", *extra) if f"{m}_mean" in final]  # FedMoE's too
    width = max([10, *(len(m) + 2 for m in metrics)])
    stats = ("mean", "weighted_mean", "std", "worst", "bottom10_mean")
    marked = ("test_acc" if "test_acc_mean" in final else "test_loss") if few_samples(worst_samples) else None
    rows = []
    for m in metrics:
        cells = [f"{final.get(f'{m}_{s}', float('nan')):>12.4f}" for s in stats]
        if m == marked:  # the mark after the worst client's number, in the next column's leading space
            k = stats.index("worst")
            cells[k] += FEW_SAMPLES_MARK
            if k + 1 < len(cells) and cells[k + 1].startswith(" "):
                cells[k + 1] = cells[k + 1][1:]
        rows.append(f"{m:{width}s}" + "".join(cells))
    if "dp_epsilon_max" in final:  # differential privacy: the ε reached, beside the accuracy (worst: the largest)
        rows.append(f"{'dp_epsilon':{width}s}" + "".join(
            cell(final[k]) if k else f"{'-':>12s}" for k in ("dp_epsilon_mean", "", "", "dp_epsilon_max", "")))
    head = f"{'':{width}s}" + "".join(f"{h:>12s}" for h in ("mean", "weighted", "std", "worst", "bottom10%"))
    notes = [few_samples_note(worst_samples)] if marked else []
    notes += [f"caveat: {caveat}"] if caveat else []
    return "\n".join([head, *rows, *notes])


def cell(value: float, width: int = 12) -> str:
    """A number right-aligned in ``width`` characters with a space before it, whatever its size: four decimals
    while they fit, else four significant digits (an ε of 10⁹ keeps the table's columns)."""
    text = f"{value:.4f}"
    if len(text) >= width:
        text = f"{value:.4g}"
    return f"{text:>{width}s}"
