"""`rayfl tune --resume DIR` from rayfl's own records only, and Tune's retry of a trial whose process died.

A real sweep of three trials (one at a time) is interrupted with SIGINT, as Ctrl-C does, once its first trial
has finished and its second has reported round 2 (module fixture, in its own process and Ray instance). Its
directory is then copied and resumed on the tests' private Ray instance: every trial once, the finished one not
run again, the interrupted one going on from its own rayfl checkpoint to the metrics of an uninterrupted run.
Tune's own state files in the copy carry payloads that write a marker when unpickled; none may run.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from conftest import Payload, tiny
from rayfl.cli import main

ROUNDS = 6
TINY = ["--dataset", "synthetic", "--partition", "iid", "--clients", "3", "--rounds", str(ROUNDS),
        "--samples-per-client", "40", "--batch-size", "16", "--clients-per-actor", "3"]  # in-process trials
LRS = (0.05, 0.1, 0.2)


def plain_run_final(lr: float) -> dict:
    """The final round of the same experiment run start to end in this process, without Tune or Ray."""
    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.runtime import LocalRuntime

    cfg = tiny(samples_per_client=40, rounds=ROUNDS, lr=lr, clients_per_actor=3)
    return Loop(prepare(cfg), LocalRuntime(prepare(cfg))).run().final


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """``(root, lines)``: ``root/tune/s`` is a sweep stopped by SIGINT after its first trial finished and its
    second reported round 2; its MLflow store is ``root/mlflow.db`` (outside the sweep directory)."""
    root = tmp_path_factory.mktemp("interrupted")
    (root / "space.yaml").write_text("grid:\n  lr: [" + ", ".join(map(str, LRS)) + "]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    # Ctrl-C as a terminal delivers it: the command's SIGINT handled as Python's default even when this test
    # runs where SIGINT is ignored (a background job of a shell passes SIG_IGN on to its children)
    cmd = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from rayfl.cli import main; sys.exit(main(sys.argv[1:]))", "tune",
           "--algo", "fedavg", "--space", str(root / "space.yaml"), *TINY, "--tracking-uri",
           f"sqlite:///{root}/mlflow.db", "--max-concurrent", "1", "--storage-path", str(root / "tune"),
           "--name", "s"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env,
                            start_new_session=True)  # its own process group: ours to clean up, nobody else's
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines, first_done, sent = [], False, False
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            first_done = first_done or " 1/3 done" in line
            if first_done and not sent and re.search(rf"^trial \S+ round 2/{ROUNDS} ", line):
                os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
                sent = True
        code = proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of that process group still alive
        except ProcessLookupError:
            pass
    assert sent and code == 130, "\n".join(lines[-30:])
    return root, lines


def copy_of(interrupted, tmp_path):
    """A copy of the interrupted sweep and its MLflow store, as one would copy it to another machine."""
    root, _ = interrupted
    dst = tmp_path / "copy"
    shutil.copytree(root, dst)
    return dst, str(dst / "tune" / "s"), f"sqlite:///{dst}/mlflow.db"


def records(sweep_dir) -> dict:
    with open(os.path.join(sweep_dir, "rayfl_trials.json")) as f:
        return json.load(f)["trials"]


def resume(sweep_dir, uri, capsys) -> tuple[int, str]:
    code = main(["tune", "--resume", sweep_dir, "--tracking-uri", uri])
    out = capsys.readouterr().out
    return code, out


def check_every_trial_once(sweep_dir, before: dict):
    """results.csv: every trial once, all DONE with every round; the trial finished before kept as it was."""
    import pandas as pd

    table = pd.read_csv(os.path.join(sweep_dir, "results.csv"))
    assert len(table) == 3 and sorted(table.lr) == sorted(LRS) and table.trial.is_unique, table
    assert set(table.status) == {"DONE"} and list(table.rounds) == [ROUNDS] * 3, table
    for key, rec in before.items():
        if rec["status"] == "DONE":
            row = table[table.trial == key].iloc[0]
            assert row.mlflow_run_id == rec["result"]["mlflow_run_id"]  # its run, not a new one
            assert row.val_acc_mean == pytest.approx(rec["result"]["val_acc_mean"], abs=1e-12)
    return table


# --------------------------------------------------------------------------------------------------
def test_interrupted_sweep_resumes_every_trial_once(ray_session, interrupted, tmp_path, capsys):
    import mlflow

    from rayfl.loop import Loop

    _, sweep_dir, uri = copy_of(interrupted, tmp_path)
    before = records(sweep_dir)
    done = [k for k, r in before.items() if r["status"] == "DONE"]
    going = [k for k, r in before.items() if r["status"] == "RUNNING"]
    assert len(done) == 1 and len(going) == 1 and len(before) == 2, before
    assert Loop.has_checkpoint(os.path.join(sweep_dir, "trials", going[0]))

    # the recorded MLflow store lies outside the copied directory: the resume will not write there unasked
    assert main(["tune", "--resume", sweep_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfl: error: ") and "\n" not in err and "tracking_uri=" in err, err

    code, out = resume(sweep_dir, uri, capsys)
    assert code == 0, out
    assert not re.search(rf"^trial {re.escape(done[0])} (started|round)", out, re.M), out  # not run again
    assert re.search(rf"^trial {going[0]} started: lr=\S+ \(goes on from its checkpoint\)$", out, re.M), out
    rounds = re.findall(r"^trial \S+ round (\S+) ", out, re.M)
    assert rounds and all(re.fullmatch(rf"\d+/{ROUNDS}", r) for r in rounds), rounds  # never "?/?"
    assert [line.split()[2] for line in out.splitlines() if " done, elapsed " in line] == ["2/3", "3/3"]
    table = check_every_trial_once(sweep_dir, before)

    after = records(sweep_dir)
    # it went on from its checkpoint, not from round 1 (its process may have run a few more rounds before the
    # interrupted sweep shut Ray down: up to all of them, leaving nothing to run)
    assert after[going[0]]["result"]["rounds_run"] < ROUNDS
    for row in table.itertuples():  # every trial's final metrics: those of a run never interrupted
        final = plain_run_final(row.lr)
        assert row.val_acc_mean == pytest.approx(final["val_acc_mean"], abs=1e-6), row
        assert row.test_acc_mean == pytest.approx(final["test_acc_mean"], abs=1e-6), row

    mlflow.set_tracking_uri(uri)
    kids = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rayfl.role` = 'trial'")
    assert len(kids) == 3 and set(kids.status) == {"FINISHED"}  # one run per trial, the continued one reopened
    assert set(kids.run_id) == set(table.mlflow_run_id)

    code, out = resume(sweep_dir, uri, capsys)  # nothing left: no trial runs, the table is the same
    assert code == 0 and "resuming: 3 trial(s) finished (kept), 0 go on from their checkpoints, 0 not started" in out
    assert " started: " not in out
    assert check_every_trial_once(sweep_dir, before).equals(table)


TUNE_FILES = ["tuner.pkl", "basic-variant-state", "experiment_state"]


def plant(sweep_dir: str, which: str, marker) -> None:
    """A payload in one of Tune's state files: unpickling any of them writes ``marker``."""
    import glob

    blob = pickle.dumps(Payload(marker))
    if which == "tuner.pkl":
        with open(os.path.join(sweep_dir, "tuner.pkl"), "wb") as f:
            f.write(blob)
    elif which == "basic-variant-state":  # a cloudpickle file despite its name
        with open(os.path.join(sweep_dir, "basic-variant-state-9999-12-31_23-59-59.json"), "wb") as f:
            f.write(blob)
    else:  # a trial's storage entry: Tune's JSON keeps objects it cannot encode as pickled hex
        [path] = glob.glob(os.path.join(sweep_dir, "experiment_state-*.json"))
        with open(path) as f:
            state = json.load(f)
        trial_json = json.loads(state["trial_data"][0][0])
        trial_json["storage"] = {"_type": "CLOUDPICKLE_FALLBACK", "value": blob.hex()}
        state["trial_data"][0][0] = json.dumps(trial_json)
        with open(path, "w") as f:
            json.dump(state, f)


def test_resume_never_reads_tunes_pickles(ray_session, interrupted, tmp_path, capsys):
    """All three of Tune's state files carry a payload, each with its own marker: a resume that read any of
    them would write its marker (or fail); it ends as a clean one does, from rayfl's records."""
    _, sweep_dir, uri = copy_of(interrupted, tmp_path)
    markers = {which: tmp_path / f"code-ran-from-{which}" for which in TUNE_FILES}
    for which, marker in markers.items():
        plant(sweep_dir, which, marker)
    before = records(sweep_dir)
    code, out = resume(sweep_dir, uri, capsys)
    assert not [which for which, marker in markers.items() if marker.exists()], "resuming ran code"
    assert code == 0, out
    check_every_trial_once(sweep_dir, before)


def test_a_trials_old_pickle_checkpoint_is_one_line_before_ray(interrupted, tmp_path, capsys):
    """A continuing trial whose directory holds a pickle checkpoint of an older rayfl (with a payload): the
    resume is refused in one line naming the file, before Ray starts, and the pickle is never opened."""
    import ray

    _, sweep_dir, uri = copy_of(interrupted, tmp_path)
    [going] = [k for k, r in records(sweep_dir).items() if r["status"] == "RUNNING"]
    trial = os.path.join(sweep_dir, "trials", going)
    for name in os.listdir(trial):
        if name.startswith("checkpoint"):
            os.remove(os.path.join(trial, name))
    marker = tmp_path / "code-ran"
    with open(os.path.join(trial, "checkpoint.pkl"), "wb") as f:
        pickle.dump({"step": 0, "server": Payload(str(marker))}, f)
    was_up = ray.is_initialized()
    code = main(["tune", "--resume", sweep_dir, "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"rayfl: error: checkpoint={trial}/checkpoint.pkl: a pickle checkpoint of an older rayfl, "
                          "not loaded"), err
    assert not marker.exists() and ray.is_initialized() == was_up


def test_the_planted_payloads_are_live(interrupted, tmp_path):
    """The same payloads, planted in a copy, run when Tune's own loaders (what Tuner.restore calls) read them."""
    import glob

    from ray.tune.experiment.trial import Trial
    from ray.tune.utils.util import _load_newest_checkpoint

    _, sweep_dir, _ = copy_of(interrupted, tmp_path)
    markers = {which: tmp_path / f"code-ran-from-{which}" for which in TUNE_FILES}
    for which, marker in markers.items():
        plant(sweep_dir, which, marker)
    with open(os.path.join(sweep_dir, "tuner.pkl"), "rb") as f:
        pickle.load(f)
    _load_newest_checkpoint(sweep_dir, "basic-variant-state-*.json")
    [path] = glob.glob(os.path.join(sweep_dir, "experiment_state-*.json"))
    with open(path) as f:
        planted = json.load(f)["trial_data"][0][0]
    try:
        Trial.from_json_state(planted)
    except Exception:  # noqa: BLE001 - the payload has run by the time Tune finds no storage context in it
        pass
    assert [which for which, marker in markers.items() if marker.exists()] == TUNE_FILES


# ------------------------------------------------------------------------- a sweep's record, checked
def edit_meta(sweep_dir: str, change) -> None:
    path = os.path.join(sweep_dir, "rayfl_sweep.json")
    with open(path) as f:
        meta = json.load(f)
    change(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def _set(key, value):
    return lambda meta: meta.__setitem__(key, value)


BAD_RECORDS = [
    ("rayfl_sweep.json", lambda m: m.pop("metric"), "rayfl_sweep.json: no key 'metric'"),
    ("rayfl_sweep.json", lambda m: m.pop("n_trials"), "rayfl_sweep.json: no key 'n_trials'"),
    ("rayfl_sweep.json", lambda m: m["space"].update(random={"lr": {"run": ["echo hi"]}}),
     "random.lr: unknown distribution 'run'"),
    ("rayfl_sweep.json", lambda m: m["space"]["fixed"].update(out_dir="/tmp/elsewhere"), "space.fixed.out_dir"),
    ("rayfl_sweep.json", _set("stage_cache", "/tmp/elsewhere/stages"), "stage_cache='/tmp/elsewhere/stages'"),
    ("rayfl_sweep.json", _set("max_concurrent", 0.5), "max_concurrent=0.5: must be an integer >= 1"),
    ("rayfl_sweep.json", _set("search", "os.system"), "search='os.system': must be one of grid, random, optuna"),
    ("rayfl_sweep.json", lambda m: m["base"].update(batch_size=-1), "batch_size=-1"),
    ("rayfl_trials.json", None, "no rayfl_trials.json there"),
    ("rayfl_trials.json", {"trials": {"../../x": {"config": {"lr": 0.1}, "status": "RUNNING"}}}, "trials.'../../x': not a trial record"),
    ("rayfl_trials.json", {"trials": {"a": {"config": {"lr": 0.1}, "status": "PICKLED"}}}, "trials.a.status"),
    ("rayfl_trials.json", {"trials": {"a": {"config": {"lr": "x"}, "status": "RUNNING"}}}, "trials.a.config: lr="),
]


@pytest.mark.parametrize("name, change, expected", BAD_RECORDS)
def test_a_bad_record_is_one_line_before_anything_runs(interrupted, tmp_path, capsys, name, change, expected):
    _, sweep_dir, uri = copy_of(interrupted, tmp_path)
    path = os.path.join(sweep_dir, name)
    if name == "rayfl_sweep.json":
        edit_meta(sweep_dir, change)
    elif change is None:
        os.remove(path)
    else:
        with open(path, "w") as f:
            json.dump(change, f)
    before = sorted(os.listdir(sweep_dir))
    assert main(["tune", "--resume", sweep_dir, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfl: error: ") and "\n" not in err, err
    assert expected in err and name in err, err
    assert sorted(os.listdir(sweep_dir)) == before  # nothing written


def test_stage_cache_given_again_is_used(interrupted, tmp_path):
    """A recorded stage cache outside the directory is refused; one given on the command line is used."""
    from rayfl.sweep.resume import prepare_resume

    _, sweep_dir, uri = copy_of(interrupted, tmp_path)
    edit_meta(sweep_dir, _set("stage_cache", "/tmp/elsewhere/stages"))
    meta = prepare_resume(sweep_dir, uri, str(tmp_path / "cache"))
    assert meta["stage_cache"] == str(tmp_path / "cache") and meta["tracking_uri"] == uri
    assert meta["storage"] == os.path.dirname(sweep_dir)  # Tune writes where the directory is now
    edit_meta(sweep_dir, _set("stage_cache", os.path.join(sweep_dir, "mine")))  # inside: kept
    assert prepare_resume(sweep_dir, uri)["stage_cache"] == os.path.join(sweep_dir, "mine")


# ------------------------------------------------------------------------- what is left, computed
def test_left_over_takes_each_grid_point_as_often_as_it_is_owed():
    from rayfl.sweep.records import TRIAL_KEY
    from rayfl.sweep.resume import left_over
    from rayfl.sweep.space import Plan, Space

    space = Space("s.yaml", grid={"lr": [0.1, 0.2]}, random={"local_epochs": ("randint", (1, 3))})
    meta = {"plan": Plan("fedavg", {"algo": "fedavg"}, space, []), "search": "grid", "num_samples": 2,
            "n_trials": 4, "seed": 0}
    recs = {"a": {"config": {"lr": 0.1, "local_epochs": 2}, "status": "DONE", "result": {}},
            "b": {"config": {"lr": 0.1, "local_epochs": 1}, "status": "RUNNING", "result": {}},
            "c": {"config": {"lr": 0.2, "local_epochs": 3}, "status": "STOPPED", "result": {}}}
    configs, more = left_over(meta, recs)
    assert more == 0
    assert configs[0] == {"lr": 0.1, "local_epochs": 1, TRIAL_KEY: "b"}  # goes on from its checkpoint
    assert [c["lr"] for c in configs[1:]] == [0.2]  # 0.1 twice and 0.2 once taken of 2 x {0.1, 0.2}
    assert type(configs[1]["local_epochs"]) is int and 1 <= configs[1]["local_epochs"] <= 3
    meta.update(search="random", num_samples=5, n_trials=5)
    configs, _ = left_over(meta, recs)
    assert len(configs) == 1 + 2 and all(c["lr"] in (0.1, 0.2) for c in configs)


def test_listed_searcher_hands_out_its_list_then_asks_the_model():
    """A resumed optuna sweep: the unfinished trials first, then the model's suggestions, and only the trials
    it suggested are reported back to it."""
    from ray.tune.search import Searcher

    from rayfl.sweep.resume import listed_searcher

    class Model(Searcher):  # stands in for Optuna (not installed here)
        def __init__(self):
            super().__init__(metric="val_acc_mean", mode="max")
            self.told = []

        def suggest(self, trial_id):
            return {"lr": 0.3}

        def on_trial_complete(self, trial_id, result=None, error=False):
            self.told.append(trial_id)

    model = Model()
    s = listed_searcher([{"lr": 0.1, "rayfl_trial": "k0"}], "val_acc_mean", "max", then=model)
    assert s.suggest("a") == {"lr": 0.1, "rayfl_trial": "k0"} and s.suggest("b") == {"lr": 0.3}
    s.on_trial_complete("a", {"val_acc_mean": 0.5})
    s.on_trial_complete("b", {"val_acc_mean": 0.6})
    assert model.told == ["b"]
    assert listed_searcher([], "val_acc_mean", "max").suggest("c") == Searcher.FINISHED


# ------------------------------------------------------------------------- Tune's retry, fault-injected
def test_a_trial_whose_process_is_killed_is_retried_from_its_checkpoint(ray_session, tmp_path, capsys, monkeypatch):
    """SIGKILL to the trial's process at round 3 (the process Tune runs it in, of our own Ray instance): Tune
    retries it (FailureConfig max_failures = max_restarts), it goes on from its own rayfl checkpoint, and its
    final metrics are those of a run never interrupted."""
    import mlflow
    import pandas as pd

    from rayfl.sweep import command

    real, killed = command._progress_callback, []

    def killing(*args, **kwargs):
        cb = real(*args, **kwargs)
        seen = cb.on_trial_result

        def on_trial_result(iteration, trials, trial, result, **info):
            seen(iteration, trials, trial, result, **info)
            if result.get("round") == 3 and not killed:
                killed.append(result["pid"])
                os.kill(result["pid"], signal.SIGKILL)

        cb.on_trial_result = on_trial_result
        return cb

    monkeypatch.setattr(command, "_progress_callback", killing)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (tmp_path / "space.yaml").write_text("grid:\n  lr: [0.1]\n")
    code = main(["tune", "--algo", "fedavg", "--space", str(tmp_path / "space.yaml"), *TINY, "--tracking-uri", uri,
                 "--max-concurrent", "1", "--storage-path", str(tmp_path / "tune"), "--name", "k"])
    out = capsys.readouterr().out
    assert code == 0 and killed and killed[0] != os.getpid(), out
    assert re.search(r"^trial \S+ lost its process; retried \(1 so far\)", out, re.M), out
    sweep_dir = tmp_path / "tune" / "k"
    [rec] = records(sweep_dir).values()
    assert rec["status"] == "DONE" and rec["result"]["round"] == ROUNDS
    assert 0 < rec["result"]["rounds_run"] < ROUNDS  # the retry went on from a checkpoint after round >= 1
    assert rec["result"]["pid"] != killed[0]
    table = pd.read_csv(sweep_dir / "results.csv")
    final = plain_run_final(0.1)
    assert len(table) == 1 and table.rounds[0] == ROUNDS
    assert table.val_acc_mean[0] == pytest.approx(final["val_acc_mean"], abs=1e-6)
    assert table.test_acc_mean[0] == pytest.approx(final["test_acc_mean"], abs=1e-6)
    mlflow.set_tracking_uri(uri)
    kids = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rayfl.role` = 'trial'")
    assert len(kids) == 1 and kids.status[0] == "FINISHED"  # the retry reopened the trial's run
