"""A tracking server that goes away: a real ``mlflow server`` on 127.0.0.1 (a free port, a private store and
artifact root, its own process group, killed by its group id), stopped in the middle of runs.

A server back before the run's end gets everything, and no round waits for it; one gone for good costs the
run at most ``tracking_wait`` seconds, its records stay in the run directory and ``rayfl sync`` delivers them
to the same MLflow run, once; a server down at the start, and URI mistakes, are one line before anything
starts; a resumed run logs each (key, step) once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from conftest import tiny
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop
from rayfl.runtime import LocalRuntime
from rayfl.tracking import MlflowTracker

RAYFL = [sys.executable, "-m", "rayfl.cli"]
MLFLOW = os.path.join(os.path.dirname(sys.executable), "mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` on 127.0.0.1 with a private backend store and artifact root, in its own process
    group; ``stop`` kills that group (SIGKILL: a server that vanishes), ``start`` brings it back on the same
    port and store."""

    def __init__(self, root):
        self.root, self.port, self.proc = root, free_port(), None
        self.store = f"sqlite:///{root}/mlflow.db"
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None) -> "Server":
        self.port = port or self.port
        self.uri = f"http://127.0.0.1:{self.port}"
        log = open(os.path.join(self.root, f"server-{self.port}.log"), "ab")
        self.proc = subprocess.Popen([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--workers", "1", "--backend-store-uri", self.store,
                                      "--artifacts-destination", os.path.join(self.root, "artifacts")],
                                     stdout=log, stderr=log, start_new_session=True, cwd=self.root)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.uri}/health", timeout=1).read() == b"OK":
                    return self
            except OSError:
                pass
            assert self.proc.poll() is None, open(log.name).read()[-2000:]
            time.sleep(0.2)
        raise AssertionError("mlflow server did not come up in 90 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("mlflow-server")).start()
    yield s
    s.stop()


def points(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


class Pace(Callback):
    """Makes each round last about ``seconds`` (the clients' work, in a real run), records when each round
    was reported, and calls ``at(step)`` after it."""

    def __init__(self, seconds: float, at=lambda step: None):
        self.seconds, self.at, self.times = seconds, at, []

    def on_round(self, loop, record) -> None:
        self.times.append(time.monotonic())
        self.at(record.step)
        time.sleep(self.seconds)


def test_a_server_back_after_an_outage_gets_everything_and_no_round_waits(server, tmp_path):
    """The server is killed after round 2 and restarted on its port and store 6 s later (up and answering a few
    seconds after that). Rounds 3-8 run
    during the outage at their own pace (two checkpoints among them, which keep what was not sent in the run
    directory rather than wait), the run's end waits for the server, and then every round's metrics (once per
    step), its tables and final artifacts are in the same MLflow run, FINISHED, with no outbox left."""
    if server.proc is None:  # a test before stopped it
        server.start()
    rounds = 8
    p = prepare(tiny(algo="fedavg", rounds=rounds, checkpoint_every=3, tracking_wait=300))
    restarted, back = threading.Event(), []

    def at(step):
        if step == 1:  # round 2 reported: the server goes away, and comes back later
            server.stop()
            threading.Timer(6.0, lambda: (server.start(), back.append(time.monotonic()), restarted.set())).start()

    pace = Pace(0.3, at)
    tracker = MlflowTracker(server.uri, experiment="outage")
    loop = Loop(p, LocalRuntime(p), [tracker, pace], checkpoint_dir=str(tmp_path / "run"))
    loop.run()
    assert restarted.is_set(), "the run ended before the server came back: it did not wait"
    gaps = [b - a for a, b in zip(pace.times, pace.times[1:])]
    assert max(gaps) < 5.0, gaps  # no round waited for the server (each takes ~0.3 s here; the outage 8+ s)
    assert pace.times[-1] < back[0]  # every round done while the server was still away
    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    for key in ("test_acc_mean", "round_seconds", "participants"):
        expected = [(h["step"] + 1, float(h[key])) for h in loop.history] if key != "participants" else \
            [(s, 3.0) for s in range(1, rounds + 1)]
        assert points(client, tracker.run_id, key) == expected, key
    tables = sorted(a.path for a in client.list_artifacts(tracker.run_id, "results/clients"))
    assert tables == [f"results/clients/round_{r:04d}.csv" for r in range(1, rounds + 1)]
    assert {a.path for a in client.list_artifacts(tracker.run_id, "models")} == {"models/global.npy"}
    assert "results/final.json" in {a.path for a in client.list_artifacts(tracker.run_id, "results")}
    assert "mlflow.note.content" in run.data.tags and tracker.unsent is None
    assert not os.path.exists(tmp_path / "run" / "mlflow_outbox")


def run_until_the_server_goes(server, args: list[str], cwd, ready) -> tuple[subprocess.CompletedProcess, float]:
    """``rayfl ARGS`` against ``server`` (started if a test before stopped it), stopped for good as soon as
    ``ready()`` is true; to the command's end. Returns its outcome and how long it ran on after the stop."""
    if server.proc is None:
        server.start()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([*RAYFL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=env, start_new_session=True)
    try:
        while not ready() and proc.poll() is None:
            time.sleep(0.02)
        server.stop()
        t_down = time.monotonic()
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), time.monotonic() - t_down


def test_a_server_gone_for_good_costs_tracking_wait_then_sync_delivers_once(server, tmp_path):
    """``rayfl run`` against a server killed as soon as the MLflow run exists: the run trains to its end, waits
    ``--tracking-wait 3`` seconds, exits 0 with one line naming the run directory and ``rayfl sync``; the
    records (JSON lines, the artifact files) are in the run directory. A server on the same store, on another
    port, then gets them all from ``rayfl sync RUN_DIR --tracking-uri``, in the same run; a second sync (the
    API's) sends nothing."""
    run_dir = tmp_path / "runs" / "gone"
    done, waited = run_until_the_server_goes(
        server, ["run", "--dataset", "synthetic", "--partition", "iid", "--clients", "2", "--rounds", "4",
                 "--samples-per-client", "60", "--tracking-uri", server.uri, "--experiment", "gone", "--tracking-wait",
                 "3", "--out-dir", str(tmp_path / "runs"), "--run-name", "gone", "--quiet"], tmp_path,
        lambda: (run_dir / "mlflow_run_id").exists())
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if "rayfl sync" in line]
    assert lines == [f"rayfl: warning: the tracking server at {server.uri} did not answer within tracking_wait=3 s; "
                     f"the results are complete, the MLflow records not sent are kept in {run_dir}/mlflow_outbox; "
                     f"send them with: rayfl sync {run_dir}"], stderr[-2000:]
    assert "bottom10%" in stdout and waited < 60
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    box = run_dir / "mlflow_outbox"
    assert json.loads((box / "run.json").read_text())["run_id"] == run_id
    kept = [json.loads(line) for line in (box / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m["step"] for m in kept if m["key"] == "test_acc_mean") == [1, 2, 3, 4]
    assert list(box.glob("files/*/models/global.npy")) and list(box.glob("files/*/results/clients/round_0004.csv"))

    server.start(port=free_port())  # the same store, elsewhere
    try:
        out = subprocess.run([*RAYFL, "sync", str(run_dir), "--tracking-uri", server.uri], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"sent to MLflow run {run_id}" in out.stdout
        client = MlflowClient(server.uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "gone"
        with open(client.download_artifacts(run_id, "results/final.json", str(tmp_path))) as f:
            assert json.load(f)["round"] == 4
        history = points(client, run_id, "test_acc_mean")
        assert [s for s, _ in history] == [1, 2, 3, 4]
        by_step = {m["step"]: m["value"] for m in kept if m["key"] == "test_acc_mean"}
        assert history == sorted(by_step.items())
        assert run.data.params["rounds"] == "4" and "mlflow.note.content" in run.data.tags
        assert [a.path for a in client.list_artifacts(run_id, "models")] == ["models/global.npy"]
        assert len(client.list_artifacts(run_id, "results/clients")) == 4
        counts = {k: len(client.get_metric_history(run_id, k)) for k in run.data.metrics}

        import rayfl

        again = rayfl.sync(str(run_dir), tracking_uri=server.uri)
        assert again == {"metrics": 0, "params": 0, "tags": 0, "files": 0, "status": None}
        assert {k: len(client.get_metric_history(run_id, k)) for k in run.data.metrics} == counts
    except BaseException:  # on success the server stays up, for the next test's run (started only if none is)
        server.stop()
        raise


def test_a_comparison_whose_server_is_gone_keeps_its_table_and_records_and_sync_sends_them(server, tmp_path):
    """``rayfl compare`` against a server killed once its run's MLflow run exists: the comparison ends (exit
    0) with its table on disk and one line giving ``rayfl sync`` of its directory, which then sends the
    parent's table and the run's rounds to a server on the same store, once."""
    from rayfl.tracking.outbox import kept_runs

    folder = tmp_path / "runs" / "compare" / "gone"
    out, _ = run_until_the_server_goes(
        server, ["compare", "--local", "--algos", "fedavg", "--seeds", "0", "--dataset", "synthetic", "--partition",
                 "iid", "--clients", "2", "--rounds", "8", "--samples-per-client", "60", "--tracking-uri", server.uri,
                 "--experiment", "cgone", "--tracking-wait", "2", "--out-dir", str(tmp_path / "runs"), "--name", "gone",
                 "--quiet"], tmp_path, lambda: (folder / "fedavg_s0" / "mlflow_run_id").exists())
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if "rayfl sync" in line] == [
        f"rayfl: warning: the tracking server at {server.uri} did not answer; 2 run(s) kept MLflow records it did not "
        f"get (each in its directory's mlflow_outbox): send them with: rayfl sync {folder}; the table is in "
        f"{folder}/table.md"], out.stderr[-2000:]
    assert "| fedavg | 1 |" in (folder / "table.md").read_text()
    assert kept_runs(str(folder)) == [str(folder), str(folder / "fedavg_s0")]  # the parent's records, the run's

    server.start(port=free_port())  # the same store, elsewhere
    try:
        synced = subprocess.run([*RAYFL, "sync", str(folder), "--tracking-uri", server.uri], capture_output=True,
                                text=True, timeout=120)
        assert synced.returncode == 0 and synced.stdout.count("sent to MLflow run") == 2, synced.stderr[-2000:]
        client = MlflowClient(server.uri)
        child_id = (folder / "fedavg_s0" / "mlflow_run_id").read_text().strip()
        child = client.get_run(child_id)
        parent = client.get_run(child.data.tags["mlflow.parentRunId"])
        assert parent.info.status == child.info.status == "FINISHED"
        assert parent.data.tags["mlflow.note.content"].startswith("| algorithm | test mean (%) |")
        assert {"compare/table.md", "compare/comparison.png"} <= {a.path for a in client.list_artifacts(
            parent.info.run_id, "compare")}
        assert parent.data.metrics["compare/test_acc_mean/fedavg"] == pytest.approx(child.data.metrics["test_acc_mean"])
        assert [s for s, _ in points(client, child_id, "test_acc_mean")] == list(range(1, 9))
        import rayfl

        nothing = {"metrics": 0, "params": 0, "tags": 0, "files": 0, "status": None}
        assert rayfl.sync(str(folder), tracking_uri=server.uri) == {str(folder): nothing,
                                                                     str(folder / "fedavg_s0"): nothing}
    except BaseException:  # on success the server stays up, for the next test's run (started only if none is)
        server.stop()
        raise


def test_a_sweep_whose_server_is_gone_ends_with_its_results_and_sync_sends_its_trials(server, tmp_path):
    """``rayfl tune`` against a server killed once its trial's MLflow run exists: the sweep ends (exit 0) with
    its results table, a line saying its parent run was not updated and one giving ``rayfl sync`` of the
    sweep's directory, which sends the trial's rounds."""
    space = tmp_path / "space.yaml"
    space.write_text("grid:\n  lr: [0.1]\n")
    sweep = tmp_path / "runs" / "tune" / "gone"
    trials = lambda: list(sweep.glob("trials/*/mlflow_run_id"))  # noqa: E731
    out, _ = run_until_the_server_goes(
        server, ["tune", "--algo", "fedavg", "--space", str(space), "--dataset", "synthetic", "--partition", "iid",
                 "--clients", "2", "--rounds", "8", "--samples-per-client", "60", "--tracking-uri", server.uri,
                 "--experiment", "tgone", "--tracking-wait", "2", "--out-dir", str(tmp_path / "runs"), "--name",
                 "gone", "--quiet"], tmp_path, lambda: len(trials()) == 1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sweep results (best first)" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("rayfl: warning")]
    assert warnings[-2:] == [
        f"rayfl: warning: the tracking server at {server.uri} did not answer; the sweep's parent run "
        f"{json.loads((sweep / 'rayfl_sweep.json').read_text())['parent_run_id']} was not updated; the results are "
        f"in {sweep}/results.csv",
        f"rayfl: warning: the tracking server at {server.uri} did not answer; 1 trial(s) kept MLflow records it did "
        f"not get (each in its directory's mlflow_outbox): send them with: rayfl sync {sweep}"], out.stderr[-3000:]
    server.start(port=free_port())
    try:
        synced = subprocess.run([*RAYFL, "sync", str(sweep), "--tracking-uri", server.uri], capture_output=True,
                                text=True, timeout=120)
        assert synced.returncode == 0 and synced.stdout.count("sent to MLflow run") == 1, synced.stderr[-2000:]
        client = MlflowClient(server.uri)
        [path] = trials()
        run_id = path.read_text().strip()
        assert client.get_run(run_id).info.status == "FINISHED"
        assert [s for s, _ in points(client, run_id, "test_acc_mean")] == list(range(1, 9))
    except BaseException:  # on success the server stays up, for the next test's run (started only if none is)
        server.stop()
        raise


def test_a_server_down_at_the_start_is_one_line_for_run_tune_and_compare(tmp_path):
    """Nothing listens at the URI: ``run``, ``tune`` and ``compare`` each say so in one line and exit 2, before
    Ray starts, in well under 10 s of the command's own time (its imports and data preparation included; the
    three run side by side, and on a loaded machine their wall time is mostly waiting for a core, so it is
    bounded loosely: before, they did not end in 165 s)."""
    uri = f"http://127.0.0.1:{free_port()}"
    common = ["--dataset", "synthetic", "--partition", "iid", "--clients", "2", "--rounds", "1",
              "--samples-per-client", "60", "--tracking-uri", uri, "--out-dir", str(tmp_path / "runs")]
    commands = {"run": ["run", *common], "tune": ["tune", "--algo", "fedavg", *common],
                "compare": ["compare", "--algos", "fedavg", "--seeds", "0", *common]}
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    procs = {name: subprocess.Popen([*RAYFL, *args], stdout=open(tmp_path / f"{name}.out", "w"),
                                    stderr=open(tmp_path / f"{name}.err", "w"), cwd=tmp_path, env=env)
             for name, args in commands.items()}
    for name, proc in procs.items():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.05)
        else:
            proc.kill()
            raise AssertionError(f"{name} did not end in 90 s")
        wall, cpu = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
        stderr = (tmp_path / f"{name}.err").read_text()
        lines = stderr.strip().splitlines()
        assert os.waitstatus_to_exitcode(status) == 2 and len(lines) == 1, (name, stderr[-2000:])
        assert lines[0] == (f"rayfl: error: tracking_uri='{uri}': cannot open experiment 'rayfl' there (no server "
                            f"answers at 127.0.0.1:{uri.rsplit(':', 1)[1]}: Connection refused)"), (name, lines)
        assert cpu < 10.0 and wall < 60.0, (name, cpu, wall)
        assert "Ray" not in (tmp_path / f"{name}.out").read_text() + stderr
    assert not (tmp_path / "runs").exists()  # nor a run directory, nor a sweep's storage


@pytest.mark.parametrize("uri, message", [
    ("http://", "tracking_uri='http://': no host; expected http://HOST[:PORT]"),
    ("https://:5000", "tracking_uri='https://:5000': no host; expected https://HOST[:PORT]"),
    ("http://127.0.0.1:port", "tracking_uri='http://127.0.0.1:port': the port must be a number in 0-65535"),
    ("", "tracking_uri='': empty; give a URI, or leave it out for $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"),
])
def test_tracking_uri_mistakes_are_one_line_at_once(uri, message, tmp_path, capsys, monkeypatch):
    """A server URI with no host (or a port that is not a number) and an empty URI (which would silently mean
    $MLFLOW_TRACKING_URI) are refused at once, from the command and from the API."""
    from rayfl.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")
    t0 = time.monotonic()
    assert main(["run", "--tracking-uri", uri, "--out-dir", str(tmp_path)]) == 2
    assert time.monotonic() - t0 < 5
    assert capsys.readouterr().err.splitlines() == [f"rayfl: error: {message}"]
    with pytest.raises(UserError, match="^" + message.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")):
        tiny(tracking_uri=uri).check()
    assert not os.path.exists(tmp_path / "elsewhere.db")


@pytest.mark.parametrize("wait", [-1.0, float("nan"), float("inf")])
def test_tracking_wait_must_be_finite_and_not_negative(wait):
    with pytest.raises(UserError, match=r"^tracking_wait=\S+: must be a finite number"):
        tiny(tracking_wait=wait).check()


def test_compare_local_refuses_a_sqlite_store_run_refuses_and_makes_no_directory(tmp_path, capsys):
    from rayfl.cli import main

    missing = tmp_path / "no" / "such" / "dir"
    code = main(["compare", "--local", "--algos", "fedavg", "--seeds", "0", "--dataset", "synthetic",
                 "--clients", "2", "--rounds", "1", "--samples-per-client", "60",
                 "--tracking-uri", f"sqlite:///{missing}/mlflow.db", "--out-dir", str(tmp_path / "runs")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"rayfl: error: tracking_uri='sqlite:///{missing}/mlflow.db': cannot "
                                               f"open experiment 'rayfl' there (no directory {missing})")
    assert not (tmp_path / "no").exists()


def test_a_resumed_run_logs_each_round_once(tmp_path):
    """A run checkpointed after round 2 goes on to round 4; resumed from that checkpoint into the same MLflow
    run (as a restarted driver is), it replays rounds 3-4 but logs them (metrics and tables) only once."""
    import shutil

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir, saved = tmp_path / "run", tmp_path / "saved"
    p = prepare(tiny(algo="fedavg", rounds=4, checkpoint_every=2))

    class Keep(Callback):  # the checkpoint of round 2, as a driver killed in round 3 would have left it
        def on_round(self, loop, record):
            if record.step == 2:
                shutil.copytree(run_dir, saved)

    first = MlflowTracker(uri, experiment="resume")
    Loop(p, LocalRuntime(p), [first, Keep()], checkpoint_dir=str(run_dir)).run()
    shutil.rmtree(run_dir)
    shutil.copytree(saved, run_dir)
    again = MlflowTracker(uri, experiment="resume", run_id=first.run_id)
    loop = Loop(p, LocalRuntime(p), [again], checkpoint_dir=str(run_dir))
    loop.run()
    assert loop.start_step == 2 and again.run_id == first.run_id
    client = MlflowClient(uri)
    for key in ("test_acc_mean", "participants", "tracking_cpu_seconds"):
        assert [s for s, _ in points(client, first.run_id, key)] == [1, 2, 3, 4], key
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_a_stop_the_driver_cannot_honour_in_its_grace_still_ends_the_mlflow_run_killed(ray_session, mlflow_uri,
                                                                                        tmp_path):
    """Ctrl-C while a round outlasts the grace (here: no grace at all): the driver is killed mid-run, and the
    submitter closes its MLflow run as KILLED, not RUNNING, with the rounds already delivered kept."""
    from rayfl.actors.launch import launch
    from rayfl.tracking import ensure_experiment

    class Interrupt(Exception):
        pass

    def interrupt(rec):
        if rec["step"] == 1:
            raise Interrupt()

    exp = ensure_experiment(mlflow_uri, "tests")
    tracking = {"tracking_uri": mlflow_uri, "experiment_id": exp, "run_name": "no-grace"}
    with pytest.raises(Interrupt):
        launch(prepare(tiny(algo="fedavg", rounds=6, checkpoint_every=1)), tracking, checkpoint_dir=str(tmp_path),
               on_round=interrupt, poll_seconds=0.01, stop_grace_seconds=0.0)
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([exp], "attributes.run_name = 'no-grace'")[0]
    assert run.info.status == "KILLED"
    kept = [m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")]
    assert kept[:1] == [1] and kept == list(range(1, len(kept) + 1)) and len(kept) < 6


def test_sync_delivers_an_outbox_once_and_reads_back_what_it_wrote(tmp_path):
    """The outbox format round trip against a local store: metrics (NaN and infinities included), params,
    tags, an artifact tree and the run's end go to the named run; a last line cut short (a driver killed while
    writing it) is skipped; a second sync sends nothing, and a point the run already held is not sent twice."""
    import math

    from mlflow.entities import Metric

    import rayfl
    from rayfl.tracking.outbox import Outbox, outbox_dir

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sync")).info.run_id
    client.log_metric(run_id, "acc", 0.5, timestamp=1000, step=1)  # delivered before the server went away
    box = Outbox(outbox_dir(str(tmp_path / "run")))
    box.write_run(run_id=run_id, tracking_uri=uri, experiment_id="1", status=None, end_time=None)
    tree = box.new_files()
    os.makedirs(os.path.join(box.files, tree, "models"))
    with open(os.path.join(box.files, tree, "models", "w.txt"), "w") as f:
        f.write("weights")
    box.spill([("metrics", [Metric("acc", 0.5, 1000, 1), Metric("acc", 0.75, 2000, 2),
                            Metric("loss", math.nan, 2000, 2), Metric("loss", math.inf, 3000, 3)]),
               ("params", [("lr", "0.1")]), ("tags", [("rayfl.note", "kept")]), ("status", "FINISHED", 4000)])
    with open(os.path.join(box.dir, "metrics.jsonl"), "a") as f:
        f.write('{"key": "acc", "value": 0.9, "times')  # cut short
    sent = rayfl.sync(str(tmp_path / "run"))
    assert sent == {"metrics": 3, "params": 1, "tags": 1, "files": 1, "status": "FINISHED"}
    run = client.get_run(run_id)
    assert points(client, run_id, "acc") == [(1, 0.5), (2, 0.75)]
    loss = points(client, run_id, "loss")
    # MLflow's SQL store keeps an infinity as the largest float
    assert [s for s, _ in loss] == [2, 3] and math.isnan(loss[0][1]) and loss[1][1] in (math.inf, sys.float_info.max)
    assert run.data.params == {"lr": "0.1"} and run.data.tags["rayfl.note"] == "kept"
    assert run.info.status == "FINISHED" and run.info.end_time == 4000
    with open(client.download_artifacts(run_id, "models/w.txt", str(tmp_path))) as f:
        assert f.read() == "weights"
    assert rayfl.sync(str(tmp_path / "run")) == {"metrics": 0, "params": 0, "tags": 0, "files": 0, "status": None}
    assert len(client.get_metric_history(run_id, "acc")) == 2 and len(client.get_metric_history(run_id, "loss")) == 2


def test_a_store_that_rejects_a_record_ends_the_run_failed_not_left_running(tmp_path, monkeypatch):
    """A store that answers but rejects what it is sent (not one that is away) ends the run at a later round,
    and the MLflow run is closed as FAILED."""
    from rayfl.tracking import outbox as tracking_outbox

    original = tracking_outbox.deliver

    def rejecting(client, run_id, files_root, rec):
        if rec[0] == "metrics" and any(m.step >= 1 for m in rec[1]):
            raise ValueError("rejected by the store")
        return original(client, run_id, files_root, rec)

    monkeypatch.setattr(tracking_outbox, "deliver", rejecting)
    p = prepare(tiny(algo="fedavg", rounds=8))
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", experiment="e")
    with pytest.raises(ValueError, match="rejected by the store"):
        try:
            Loop(p, LocalRuntime(p), [tracker, Pace(0.3)], checkpoint_dir=str(tmp_path / "run")).run()
        except ValueError:
            tracker.fail()
            raise
    assert MlflowClient(tracker.uri).get_run(tracker.run_id).info.status == "FAILED"
    assert tracking_outbox.kept_runs(str(tmp_path)) == [str(tmp_path / "run")]  # what it did not take, for sync
