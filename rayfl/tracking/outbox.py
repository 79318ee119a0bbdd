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

import json
import math
import os
import shutil
import threading
import time
from collections import deque

from rayfl.tracking.store import PROBE_TIMEOUT_S, answers, server_address  # noqa: F401 - re-exported

OUTBOX = "mlflow_outbox"
RETRY_EVERY_S = 2.0  # while it is not, how often the sender looks again
BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's limits per log_batch call


def outbox_dir(run_dir: str) -> str:
    return os.path.join(run_dir, OUTBOX)


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


MAX_FILE_BYTES = 1 << 30  # one outbox file (a run's unsent metrics: about 100 bytes a point)
RUN_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
_INT64 = 2**63


def _refuse(path: str, problem: str):
    from rayfl.user_input import UserError

    return UserError(f"{path}: {problem}; an outbox holds the plain files a run wrote there (see rayfl sync --help)")


def _regular(path: str) -> bool:
    """Whether ``path`` is there; a link or anything but a regular file is refused (an outbox is read as it
    is, never through a link to what lies elsewhere), as is one larger than MAX_FILE_BYTES."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "a link or a special file, not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise _refuse(path, f"{st.st_size:,} bytes; at most {MAX_FILE_BYTES:,}")
    return True


def _is_int(v, low: int = -_INT64, high: int = _INT64) -> bool:
    return type(v) is int and low <= v < high


def _is_value(v) -> bool:
    return (type(v) in (int, float) and math.isfinite(v)) or v in ("NaN", "Infinity", "-Infinity")


def _is_key(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 1000 and v.isprintable()


def _metric_row(r) -> bool:
    return (isinstance(r, dict) and _is_key(r.get("key")) and _is_value(r.get("value"))
            and _is_int(r.get("timestamp"), 0) and _is_int(r.get("step")))


def _pair_row(r) -> bool:
    return isinstance(r, dict) and _is_key(r.get("key")) and isinstance(r.get("value"), str)


def _delivered_row(r) -> bool:
    if not isinstance(r, dict) or len(r) != 1:
        return False
    (kind, v), = r.items()
    if kind == "metric":
        return (isinstance(v, list) and len(v) == 4 and _is_key(v[0]) and _is_int(v[1]) and _is_value(v[2])
                and _is_int(v[3], 0))
    if kind in ("param", "tag"):
        return isinstance(v, list) and len(v) == 2 and _is_key(v[0]) and isinstance(v[1], str)
    if kind == "files":
        return isinstance(v, str) and v.isdigit() and len(v) <= 12
    return kind == "status" and v in RUN_STATUSES


ROWS = {"metrics.jsonl": (_metric_row, '{"key", "value": a number, "NaN", "Infinity" or "-Infinity", '
                                       '"timestamp": ms >= 0, "step": an integer}'),
        "params.jsonl": (_pair_row, '{"key", "value": a string}'),
        "tags.jsonl": (_pair_row, '{"key", "value": a string}'),
        "delivered.jsonl": (_delivered_row, '{"metric": [key, step, value, timestamp]}, {"param"|"tag": [key, value]}, '
                                            '{"files": "NNNNNN"} or {"status": STATUS}')}


def _read_lines(path: str) -> list[dict]:
    """A JSON lines file's records, each checked as its file's kind (:data:`ROWS`); a last line cut short (the
    writer was killed mid-line) is skipped, any other line that is not such a record is one line naming it."""
    if not _regular(path):
        return []
    check, shape = ROWS[os.path.basename(path)]
    out = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"), parse_constant=lambda c: c)  # NaN stays the text it was
        except (ValueError, UnicodeDecodeError):
            if number == len(lines):  # no newline after it: cut short
                continue
            raise _refuse(f"{path}:{number}", "not a line of JSON") from None
        if not check(row):
            raise _refuse(f"{path}:{number}", f"not a record {shape}")
        out.append(row)
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
        if not _regular(path):
            return {"run_id": None, "tracking_uri": None, "experiment_id": None, "status": None, "end_time": None}
        try:
            with open(path, encoding="utf-8") as f:
                run = json.load(f)
        except (ValueError, UnicodeDecodeError):
            raise _refuse(path, "not JSON") from None
        if not (isinstance(run, dict) and all(isinstance(run.get(k), (str, type(None)))
                                              for k in ("run_id", "tracking_uri", "experiment_id"))
                and run.get("status") in (None, *RUN_STATUSES) and (run.get("end_time") is None
                                                                   or _is_int(run["end_time"], 0))):
            raise _refuse(path, 'not a run record {"run_id", "tracking_uri", "experiment_id": strings, "status": '
                                f'one of {", ".join(RUN_STATUSES)} or null, "end_time": ms or null}}')
        return run

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
                       and plain_tree(os.path.join(self.files, n)))
        status = self.run().get("status")
        return {"metrics": [m for m in dict.fromkeys(metrics) if _metric_id(m) not in done["metric"]],
                "params": [p for p in dict.fromkeys(params) if p not in done["param"]],
                "tags": [t for t in dict.fromkeys(tags) if t not in done["tag"]],
                "files": files, "status": status if status and status not in done["status"] else None}

    def count(self) -> int:
        u = self.unsent()
        return len(u["metrics"]) + len(u["params"]) + len(u["tags"]) + len(u["files"]) + bool(u["status"])


def plain_tree(path: str) -> bool:
    """Whether an artifact tree holds any file; every entry in it must be a directory or a regular file (a
    link, to a file or a directory, would send what lies outside the outbox: refused in one line)."""
    import stat

    if os.path.islink(path) or not os.path.isdir(path):
        raise _refuse(path, "a link or a file, not a directory of artifact files")
    found = False
    for folder, dirs, names in os.walk(path):  # links to directories are listed in dirs and not followed
        for name in dirs + names:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise _refuse(os.path.join(folder, name), "a link or a special file, not a regular file")
        found = found or bool(names)
    return found


def _metric_id(m: tuple) -> tuple:
    """(key, step, value, timestamp), NaN compared as its text (NaN != NaN)."""
    key, step, value, ts = m
    return key, step, _number(value), ts


def metrics_record(values: dict[str, float], step: int, timestamp: int) -> tuple:
    """("metrics", [Metric]): ``values`` at ``step`` as one record for :meth:`Outbox.spill` or :func:`deliver`."""
    from mlflow.entities import Metric

    return ("metrics", [Metric(k, v, timestamp, step) for k, v in values.items()])


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
    found = []
    for folder, dirs, _ in os.walk(root):  # links to directories are not followed
        if OUTBOX in dirs and not os.path.islink(os.path.join(folder, OUTBOX)) \
                and os.path.lexists(os.path.join(folder, OUTBOX, "run.json")):
            found.append(folder)
        dirs[:] = [d for d in dirs if d != OUTBOX]
    return sorted(found, key=lambda d: (d != root, d))


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

    from rayfl.config import check_value, shown

    if not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir).strip():
        raise UserError(f"run_dir={shown(run_dir)}: must be a run directory (a path)")
    if tracking_uri is not None and not isinstance(tracking_uri, str):
        raise UserError(f"tracking_uri={shown(tracking_uri)}: must be a string (a tracking URI)")
    run_dir = os.fspath(run_dir)
    check_value("run_dir", run_dir)
    root = os.path.abspath(os.path.expanduser(run_dir))
    kept = kept_runs(root) if os.path.isdir(root) else []
    if not kept:
        raise UserError(f"run_dir={run_dir!r}: no {OUTBOX}/run.json there or below: nothing kept to send (a run "
                        "that delivered everything keeps no outbox)")
    with bounded_http():
        if kept == [root]:
            return sync_run(root, tracking_uri, say, shown=run_dir)
        return {path: sync_run(path, tracking_uri, lambda line, path=path: say(f"{line} (from {path})"))
                for path in kept}


# what one MLflow REST call of a sync may take (MLflow's defaults: 120 s a call, 7 retries with back-off)
SYNC_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


class bounded_http:
    """MLflow's HTTP calls bounded (:data:`SYNC_HTTP`) while a sync runs, unless the user set them."""

    def __enter__(self):
        self.set = [k for k in SYNC_HTTP if k not in os.environ]
        os.environ.update({k: SYNC_HTTP[k] for k in self.set})

    def __exit__(self, *exc):
        for k in self.set:
            os.environ.pop(k, None)


def sync_target(run_dir: str, run: dict, tracking_uri: str | None) -> str:
    """Where a sync sends: ``tracking_uri`` as the user gave it, else the URI the outbox's run.json records,
    checked as any --tracking-uri is and, since a directory may come from elsewhere, only a store that is
    already there (sync never makes a database or a store directory) or a server that answers its health check
    within seconds."""
    from rayfl.config import check_tracking_uri, shown, tracking_scheme
    from rayfl.tracking.store import check_tracking_store, tracking_server_problem
    from rayfl.user_input import UserError

    recorded = tracking_uri is None
    uri = run.get("tracking_uri") if recorded else tracking_uri
    where = f"{OUTBOX}/run.json's tracking_uri (in {run_dir})" if recorded else "tracking_uri"
    if recorded and not uri:
        raise UserError(f"run_dir={run_dir!r}: {OUTBOX}/run.json names no tracking URI; give one with --tracking-uri")
    try:
        check_tracking_uri(uri)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    scheme = tracking_scheme(uri)
    if scheme in ("http", "https"):
        problem = tracking_server_problem(uri)
        if problem:
            raise UserError(f"tracking_uri={shown(uri)}: {problem}; start it (the same backend store the run used) "
                            f"and sync again")
        return uri
    if recorded and scheme not in ("sqlite", "", "file"):
        raise UserError(f"{where}={shown(uri)}: a sync sends to a recorded store only where it is a server, a "
                        f"SQLite file or a store directory; give this one with --tracking-uri")
    store = uri.removeprefix("sqlite:///") if scheme == "sqlite" else uri.removeprefix("file://")
    if scheme in ("sqlite", "", "file") and (not os.path.isabs(store) if recorded else False):
        raise UserError(f"{where}={shown(uri)}: not an absolute path (a run records its store's absolute path)")
    if scheme == "sqlite" and not os.path.isfile(store) or scheme in ("", "file") and not os.path.isdir(store):
        raise UserError(f"{where}={shown(uri)}: no such store there; a sync sends to the store the run logged "
                        f"to and makes none (--tracking-uri names another)")
    check_tracking_store(uri, "(the run's)")
    return uri


def sync_run(root: str, tracking_uri: str | None = None, say=lambda line: None, shown: str | None = None) -> dict:
    """:func:`sync` of the one run whose outbox is in ``root`` (``shown``: the path as the user gave it)."""
    from rayfl.config import UserError

    run_dir = shown or root
    for path in (outbox_dir(root), os.path.join(outbox_dir(root), "files")):
        if os.path.islink(path):
            raise _refuse(path, "a link, not the run's own directory")
    box = Outbox(outbox_dir(root))
    run = box.run()
    if not run.get("run_id"):
        raise UserError(f"run_dir={run_dir!r}: {OUTBOX}/run.json names no MLflow run (the run never created one)")
    todo = box.unsent()  # every file read and checked before anything is sent
    uri = sync_target(run_dir, run, tracking_uri)
    from mlflow.entities import Metric  # (1.3 s of imports: after everything that can be refused without them)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = run["run_id"]
    try:
        client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - the run is not in that store
        raise UserError(f"tracking_uri={uri!r}: MLflow run {run_id} is not there ({type(e).__name__}); give the "
                        "URI of the server the run logged to (--tracking-uri)") from None
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
