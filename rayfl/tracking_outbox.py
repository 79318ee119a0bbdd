"""What a run has not yet delivered to its MLflow tracking store: held in memory and on disk in its run
directory, sent by a background thread that outlasts an unreachable server, and delivered later by
``rayfl sync RUN_DIR`` when the server stayed away past the run's ``tracking_wait``.

The outbox is ``RUN_DIR/mlflow_outbox/``, plain files (never pickle):

- ``run.json``: ``{"run_id", "tracking_uri", "experiment_id", "status", "end_time"}``, the MLflow run the
  records belong to (created when the run started) and how the run ended (``status`` null: it had not);
- ``metrics.jsonl``: a line ``{"key", "value", "timestamp", "step"}`` per metric point (``value`` a number,
  or one of ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; ``timestamp`` in ms since the epoch);
- ``params.jsonl`` and ``tags.jsonl``: a line ``{"key", "value"}`` each;
- ``files/NNNNNN/``: trees of artifact files, each laid out as it goes under the run's artifact root
  (``files/000003/results/clients/round_0004.csv`` is the run's ``results/clients/round_0004.csv``);
- ``delivered.jsonl``: what ``rayfl sync`` delivered, a line each: ``{"metric": [key, step, value, timestamp]}``,
  ``{"param": [key, value]}``, ``{"tag": [key, value]}``, ``{"files": "NNNNNN"}`` (its tree then removed),
  ``{"status": STATUS}``. A second sync sends nothing that a line names, nor a metric point the run holds.

While a run goes on, artifact files are written straight into ``files/`` (so a killed driver leaves them in
the run directory, not in /tmp) and removed once sent; metrics, params and tags are written to the JSON
lines files only when they could not be sent (at a checkpoint while the server is away, and at the end).
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import socket
import threading
import time
import urllib.parse
from collections import deque

OUTBOX = "mlflow_outbox"
PROBE_TIMEOUT_S = 1.0  # a TCP connect to the tracking server: is it there at all
RETRY_EVERY_S = 2.0  # while it is not, how often the sender looks again
BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's limits per log_batch call


def outbox_dir(run_dir: str) -> str:
    return os.path.join(run_dir, OUTBOX)


def server_address(uri: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) tracking URI, else None (a local store has no server to lose)."""
    if not uri.startswith(("http://", "https://")):
        return None
    url = urllib.parse.urlparse(uri)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return None
    return (url.hostname, port) if url.hostname else None


def answers(address: tuple[str, int] | None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``address`` (always, for a local store)."""
    if address is None:
        return True
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


def _number(value: float):
    return value if math.isfinite(value) else ("NaN" if value != value else "Infinity" if value > 0 else "-Infinity")


def _float(value) -> float:
    return float(value)  # float("NaN"), float("Infinity"), float("-Infinity") read the strings back


def _append_lines(path: str, rows) -> None:
    rows = list(rows)
    if rows:
        with open(path, "a") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in rows)
            f.flush()
            os.fsync(f.fileno())


def _read_lines(path: str) -> list[dict]:
    """A JSON lines file's records; a last line cut short (the writer was killed mid-line) is skipped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


class Outbox:
    """The run's ``mlflow_outbox`` directory (see the module docstring)."""

    def __init__(self, directory: str):
        self.dir = directory
        self.files = os.path.join(directory, "files")
        os.makedirs(self.files, exist_ok=True)
        taken = [int(n) for n in os.listdir(self.files) if n.isdigit()]
        self._next = max(taken, default=-1) + 1
        self._lock = threading.Lock()

    def new_files(self) -> str:
        """A new, empty ``files/NNNNNN`` tree; its name."""
        with self._lock:
            name = f"{self._next:06d}"
            self._next += 1
        os.makedirs(os.path.join(self.files, name))
        return name

    def write_run(self, **values) -> None:
        path = os.path.join(self.dir, "run.json")
        run = self.run()
        run.update(values)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(run, f, indent=1)
        os.replace(tmp, path)

    def run(self) -> dict:
        path = os.path.join(self.dir, "run.json")
        if not os.path.isfile(path):
            return {"run_id": None, "tracking_uri": None, "experiment_id": None, "status": None, "end_time": None}
        with open(path) as f:
            return json.load(f)

    def spill(self, records) -> None:
        """Records not sent, into the JSON lines files (their artifact trees are already under ``files/``)."""
        metrics, params, tags = [], [], []
        for rec in records:
            kind = rec[0]
            if kind == "metrics":
                metrics += [{"key": m.key, "value": _number(m.value), "timestamp": m.timestamp, "step": m.step}
                            for m in rec[1]]
            elif kind == "params":
                params += [{"key": k, "value": v} for k, v in rec[1]]
            elif kind == "tags":
                tags += [{"key": k, "value": v} for k, v in rec[1]]
            elif kind == "status":
                self.write_run(status=rec[1], end_time=rec[2])
        _append_lines(os.path.join(self.dir, "metrics.jsonl"), metrics)
        _append_lines(os.path.join(self.dir, "params.jsonl"), params)
        _append_lines(os.path.join(self.dir, "tags.jsonl"), tags)

    def delivered(self) -> dict[str, set]:
        done: dict[str, set] = {"metric": set(), "param": set(), "tag": set(), "files": set(), "status": set()}
        for row in _read_lines(os.path.join(self.dir, "delivered.jsonl")):
            for kind, value in row.items():
                if kind in done:
                    done[kind].add(tuple(value) if isinstance(value, list) else value)
        return done

    def record_delivered(self, kind: str, values) -> None:
        _append_lines(os.path.join(self.dir, "delivered.jsonl"),
                      ({kind: list(v) if isinstance(v, tuple) else v} for v in values))

    def unsent(self) -> dict:
        """Everything in the outbox that no sync has delivered: metrics as (key, step, value, timestamp),
        params and tags as (key, value), file trees by name, and the run's end status (or None)."""
        done = self.delivered()
        metrics = [(r["key"], int(r["step"]), _float(r["value"]), int(r["timestamp"]))
                   for r in _read_lines(os.path.join(self.dir, "metrics.jsonl"))]
        params = [(r["key"], r["value"]) for r in _read_lines(os.path.join(self.dir, "params.jsonl"))]
        tags = [(r["key"], r["value"]) for r in _read_lines(os.path.join(self.dir, "tags.jsonl"))]
        files = sorted(n for n in os.listdir(self.files) if n.isdigit() and n not in done["files"]
                       and any(os.scandir(os.path.join(self.files, n))))
        status = self.run().get("status")
        return {"metrics": [m for m in dict.fromkeys(metrics) if _metric_id(m) not in done["metric"]],
                "params": [p for p in dict.fromkeys(params) if p not in done["param"]],
                "tags": [t for t in dict.fromkeys(tags) if t not in done["tag"]],
                "files": files, "status": status if status and status not in done["status"] else None}

    def count(self) -> int:
        u = self.unsent()
        return len(u["metrics"]) + len(u["params"]) + len(u["tags"]) + len(u["files"]) + bool(u["status"])


def _metric_id(m: tuple) -> tuple:
    """(key, step, value, timestamp), NaN compared as its text (NaN != NaN)."""
    key, step, value, ts = m
    return key, step, _number(value), ts


def deliver(client, run_id: str, files_root: str, rec: tuple) -> None:
    """One record into the MLflow run: ("metrics", [Metric]), ("params", [(k, v)]), ("tags", [(k, v)]),
    ("files", NAME): the tree ``files_root/NAME``, removed once sent, or ("status", STATUS, END_MS)."""
    from mlflow.entities import Param, RunTag

    kind = rec[0]
    if kind in ("metrics", "params", "tags"):
        items = rec[1]
        if kind == "params":
            items = [Param(k, v) for k, v in items]
        elif kind == "tags":
            items = [RunTag(k, v) for k, v in items]
        size = BATCH[kind]
        for start in range(0, len(items), size):
            client.log_batch(run_id, **{kind: items[start:start + size]}, synchronous=True)
    elif kind == "files":
        path = os.path.join(files_root, rec[1])
        if os.path.isdir(path):
            if any(os.scandir(path)):
                client.log_artifacts(run_id, path)
            shutil.rmtree(path, ignore_errors=True)
    elif kind == "status":
        client.set_terminated(run_id, rec[1], end_time=rec[2])
    else:
        raise ValueError(f"unknown tracking record {kind!r}")


class Sender:
    """One background thread that sends records to the MLflow run in the order they come. A server that does
    not answer (an http store) is waited for, RETRY_EVERY_S between looks, the records kept; any other
    failure is kept and raised by :meth:`check` (a store that rejects what it is sent ends the run)."""

    def __init__(self, client, run_id: str, uri: str, outbox: Outbox, on_start=lambda: None):
        self.client, self.run_id, self.outbox = client, run_id, outbox
        self.address = server_address(uri)
        self.cpu_seconds = 0.0
        self.down_since: float | None = None  # monotonic time the server was first found away, None: it answers
        self.outages = 0
        self._backlog: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._work, args=(on_start,), name="rayfl-mlflow-sender", daemon=True)
        self._thread.start()

    def put(self, rec: tuple) -> None:
        with self._cond:
            self._backlog.append(rec)
            self._cond.notify_all()

    def _work(self, on_start) -> None:
        on_start()
        while True:
            with self._cond:
                while not self._backlog and not self._stopped:
                    self._cond.wait()
                if self._stopped or self._error is not None:
                    return
                rec = self._backlog[0]
                self._busy = True
            t0 = time.thread_time()
            try:
                if not answers(self.address):
                    self._away()
                    continue
                try:
                    if not self._deliver(rec):  # the server went away during the call: sent again later
                        self._away()
                        continue
                except Exception as e:  # noqa: BLE001 - MLflow's errors vary; an away server is told apart
                    if self.address is not None and not answers(self.address):
                        self._away()
                        continue
                    with self._cond:
                        self._error = e
                        self._cond.notify_all()
                    return
                with self._cond:
                    if self._backlog and self._backlog[0] is rec:
                        self._backlog.popleft()
                    self.down_since = None
                    self._cond.notify_all()
            finally:
                self.cpu_seconds += time.thread_time() - t0
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, rec: tuple) -> bool:
        """Send ``rec``; False when the server stopped answering during the call. The call then goes on in
        its own thread (MLflow retries it for minutes) and its outcome is ignored: the record is sent again
        once the server is back, which stores nothing twice (the same points, the same files, the same tags)."""
        if self.address is None:
            deliver(self.client, self.run_id, self.outbox.files, rec)
            return True
        outcome: dict = {}

        def call():
            t0 = time.thread_time()
            try:
                deliver(self.client, self.run_id, self.outbox.files, rec)
                outcome["ok"] = True
            except BaseException as e:  # noqa: BLE001 - handed to the sender's thread
                outcome["error"] = e
            finally:
                self.cpu_seconds += time.thread_time() - t0  # the call's CPU is the sender's

        t = threading.Thread(target=call, name="rayfl-mlflow-call", daemon=True)
        t.start()
        while True:
            t.join(RETRY_EVERY_S)
            if not t.is_alive():
                break
            if not answers(self.address):
                return False
        if "error" in outcome:
            raise outcome["error"]
        return True

    def _away(self) -> None:
        with self._cond:
            if self.down_since is None:
                self.down_since = time.monotonic()
                self.outages += 1
            self._busy = False
            self._cond.notify_all()
            self._cond.wait(RETRY_EVERY_S)

    @property
    def away(self) -> bool:
        return self.down_since is not None

    @property
    def failed(self) -> bool:
        """Whether a record was rejected (not the server being away): the sender has stopped."""
        return self._error is not None

    def answers(self) -> bool:
        """Whether the server answers now (asked from the calling thread: the sender's own may be stuck in a
        call that MLflow retries for minutes)."""
        return answers(self.address)

    def check(self) -> None:
        """Raise the first failure that was not the server being away, once."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def drain(self, timeout: float | None) -> bool:
        """Wait until every record is sent (True), at most ``timeout`` seconds (None: no bound)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._backlog or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is None else min(left, 1.0))
        self.check()
        return not self._backlog

    def spill(self) -> int:
        """Every record not sent (the one on its way included: sync sends nothing twice) into the outbox's
        files; the backlog emptied. Returns how many records."""
        with self._cond:
            records = list(self._backlog)
            self._backlog.clear()
        self.outbox.spill(records)
        return len(records)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


# --------------------------------------------------------------------------------------------------
# rayfl sync
# --------------------------------------------------------------------------------------------------
def kept_runs(root: str) -> list[str]:
    """The run directories at or below ``root`` (a run's, a sweep's, a comparison's: its parent run's records
    are at its top) that keep records, ``root`` first."""
    found = glob.glob(os.path.join(glob.escape(root), "**", OUTBOX, "run.json"), recursive=True)
    return sorted((os.path.dirname(os.path.dirname(path)) for path in found), key=lambda d: (d != root, d))


def kept_line(root: str, uri: str, what: str) -> str | None:
    """The one line a sweep or a comparison ends with when some of its runs keep records for ``rayfl sync``."""
    kept = kept_runs(root)
    if not kept:
        return None
    return (f"rayfl: warning: the tracking server at {uri} did not answer; {len(kept)} {what} kept MLflow records "
            f"it did not get (each in its directory's {OUTBOX}): send them with: rayfl sync {root}")


def sync(run_dir: str, tracking_uri: str | None = None, say=lambda line: None) -> dict:
    """Deliver what a run kept in ``RUN_DIR/mlflow_outbox`` to its MLflow run (on ``tracking_uri``, default
    the one the run used), recording each delivery: a second sync sends nothing. Returns the counts sent.
    ``run_dir`` may also hold run directories (a sweep's trials, a comparison's runs): each that keeps
    records is synced, and the counts come back by directory."""
    from rayfl.config import UserError

    root = os.path.abspath(os.path.expanduser(run_dir))
    kept = kept_runs(root) if os.path.isdir(root) else []
    if not kept:
        raise UserError(f"run_dir={run_dir!r}: no {OUTBOX}/run.json there or below: nothing kept to send (a run "
                        "that delivered everything keeps no outbox)")
    if kept == [root]:
        return sync_run(root, tracking_uri, say, shown=run_dir)
    return {path: sync_run(path, tracking_uri, lambda line, path=path: say(f"{line} (from {path})"))
            for path in kept}


def sync_run(root: str, tracking_uri: str | None = None, say=lambda line: None, shown: str | None = None) -> dict:
    """:func:`sync` of the one run whose outbox is in ``root`` (``shown``: the path as the user gave it)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from rayfl.config import UserError

    run_dir = shown or root
    box = Outbox(outbox_dir(root))
    run = box.run()
    if tracking_uri is not None:
        from rayfl.config import check_tracking_uri

        check_tracking_uri(tracking_uri)
    uri = tracking_uri or run.get("tracking_uri")
    if not run.get("run_id") or not uri:
        raise UserError(f"run_dir={run_dir!r}: {OUTBOX}/run.json names no MLflow run (the run never created one)")
    address = server_address(uri)
    if address is not None and not answers(address, timeout=3.0):
        raise UserError(f"tracking_uri={uri!r}: no server answers at {address[0]}:{address[1]}; start it (the "
                        "same backend store the run used) and sync again")
    client = MlflowClient(uri)
    run_id = run["run_id"]
    try:
        client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - the run is not in that store
        raise UserError(f"tracking_uri={uri!r}: MLflow run {run_id} is not there ({type(e).__name__}); give the "
                        "URI of the server the run logged to (--tracking-uri)") from None
    todo = box.unsent()
    sent = {"metrics": 0, "params": 0, "tags": 0, "files": 0, "status": None}
    # points the run already holds (sent before the server went away, its reply lost) are not sent again
    held = set()
    for key in dict.fromkeys(m[0] for m in todo["metrics"]):
        held.update(_metric_id((m.key, m.step, m.value, m.timestamp)) for m in client.get_metric_history(run_id, key))
    fresh = [m for m in todo["metrics"] if _metric_id(m) not in held]
    for start in range(0, len(todo["metrics"]), BATCH["metrics"]):
        chunk = todo["metrics"][start:start + BATCH["metrics"]]
        send = [Metric(k, v, ts, s) for k, s, v, ts in chunk if _metric_id((k, s, v, ts)) not in held]
        if send:
            deliver(client, run_id, box.files, ("metrics", send))
        box.record_delivered("metric", [_metric_id(m) for m in chunk])
    sent["metrics"] = len(fresh)
    for kind, rows in (("params", todo["params"]), ("tags", todo["tags"])):
        if rows:
            deliver(client, run_id, box.files, (kind, rows))
            box.record_delivered(kind[:-1], rows)
            sent[kind] = len(rows)
    for name in todo["files"]:
        deliver(client, run_id, box.files, ("files", name))
        box.record_delivered("files", [name])
        sent["files"] += 1
    if todo["status"]:
        deliver(client, run_id, box.files, ("status", todo["status"], run.get("end_time")))
        box.record_delivered("status", [todo["status"]])
        sent["status"] = todo["status"]
    say(f"rayfl sync: {sent['metrics']} metric points, {sent['params']} params, {sent['tags']} tags, "
        f"{sent['files']} artifact trees" + (f", status {sent['status']}" if sent["status"] else "")
        + f" sent to MLflow run {run_id} at {uri}" if any(v for v in sent.values()) else
        f"rayfl sync: nothing left to send to MLflow run {run_id} at {uri}")
    return sent
