"""Runs survive faults: a dead client actor or driver is replaced, state comes back from a snapshot or a
checkpoint, and the result is the uninterrupted run's. Loading a checkpoint never runs code."""

from __future__ import annotations

import io
import os
import pickle
import signal

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import Payload, same, tiny
from rayfl import snapshot
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.checkpoint import FILE as CHECKPOINT_FILE
from rayfl.loop import Callback, Loop
from rayfl.runtime import ClientsLost, LocalRuntime
from rayfl.tracking import ensure_experiment

# Small settings under which every algorithm runs all of its stages (as in test_ray_run).
ALGOS = {
    "local": {}, "fedavg": {"participation": 0.67}, "fedavg-ft": {},
    "fedfomo": {"params": {"M": 2}, "participation": 0.67},
    "persfl": {"params": {"lam_grid": [0.0, 0.5], "T_grid": [1.0]}},
    "federico": {"partition": "label-groups", "groups": 2, "params": {"M": 1}},
    "usercentric": {"partition": "label-groups", "groups": 2, "params": {"streams": 2}},
    "fedmoe": {"partition": "majority", "majority": 0.5,
               "params": {"opt_out": 0.25, "specialist_epochs": 3, "gate_epochs": 3, "patience": 2}},
    "fedprox": {"participation": 0.67},
    "fedavg-data": {"participation": 0.67, "params": {"data_frac": 0.2, "share_frac": 0.5}},
    "oracle": {"partition": "label-groups", "groups": 2, "participation": 0.67},
    "lg-fedavg": {"participation": 0.67, "params": {"fedavg_rounds": 1}},
    "fedper": {"participation": 0.67},
    "perfedavg": {"participation": 0.67, "params": {"variant": "hf"}},
    "pfedme": {"participation": 0.67, "params": {"beta": 0.5, "K": 2}},
    "mocha": {"participation": 0.67},
    "cfl": {"partition": "permutation", "groups": 2, "participation": 0.75,
            "params": {"eps1": 1e9, "eps2": 0.0, "min_rounds": 1, "min_split_size": 2}},
    "fedem": {"partition": "label-groups", "groups": 2, "participation": 0.67, "params": {"M": 2}},
}
TIMINGS = ("seconds",)  # keys that hold wall-clock times differ between any two runs


def results(history: list[dict]) -> list[dict]:
    """What a run computed, round by round: every metric but wall-clock times and fault counters."""
    return [{k: v for k, v in h.items() if not k.endswith(TIMINGS) and k != "client_restarts"} for h in history]


def assert_same_results(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(results(a), results(b)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == y[k] or (x[k] != x[k] and y[k] != y[k]), (x["step"], k, x[k], y[k])


def cfg_for(algo: str, **kw):
    return tiny(algo=algo, clients=4, rounds=3, clients_per_actor=2, **{**ALGOS[algo], **kw})


class FaultyRuntime(LocalRuntime):
    """In-process clients whose host 0 "dies" at the end of chosen client calls (counted from 1): the call's
    work is done (client state has moved on), host 0 is replaced by a fresh one, as Ray restarts an actor,
    and the call raises ClientsLost."""

    def __init__(self, prepared, fail_at=frozenset()):
        super().__init__(prepared)
        self.prepared, self.fail_at, self.calls = prepared, fail_at, 0

    def call(self, step, messages, reduce=None):
        self.calls += 1
        out = super().call(step, messages, reduce)
        if self.calls in self.fail_at:
            self.hosts[0] = LocalRuntime(self.prepared).hosts[0]
            raise ClientsLost(f"host 0 lost in call {self.calls} ({step})")
        return out


def client_states(loop) -> dict:
    return {cid: snapshot.loads(blob) for cid, blob in loop.runtime.client_states().items()}


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_every_algorithm_replays_to_the_uninterrupted_result(algo):
    """Faults early, midway and late (setup, rounds, evaluations: wherever the calls fall); each restores
    every client and the server from the in-memory snapshot and replays. Same metrics, round for round, and
    every client's state (model, personal state, optimizer, RNGs) the same at the end as without faults."""
    p = prepare(cfg_for(algo))
    full = Loop(p, FaultyRuntime(p)).run()
    n = full.runtime.calls
    faulty = FaultyRuntime(p, fail_at={2, n // 2 + 2, n + 2})
    loop = Loop(p, faulty).run()
    assert loop.restarts == 3
    assert_same_results(loop.history, full.history)
    assert same(client_states(loop), client_states(full))
    assert same(snapshot.loads(snapshot.dumps(loop.server.state_dict())),
                snapshot.loads(snapshot.dumps(full.server.state_dict())))


@pytest.mark.parametrize("full_every", [1, 2])  # every save full; a full save, then one of the clients changed
@pytest.mark.parametrize("algo", ["fedfomo", "local"])
def test_replays_are_exact_whatever_the_chain_of_saves(algo, full_every, monkeypatch):
    """Snapshots as chains of saves (rayfl.runtime.SaveChain) restore what a full save would: faults land
    on full and on partial saves."""
    from rayfl import runtime

    monkeypatch.setattr(runtime, "SAVE_FULL_EVERY", full_every)
    p = prepare(cfg_for(algo))
    full = Loop(p, FaultyRuntime(p)).run()
    n = full.runtime.calls
    loop = Loop(p, FaultyRuntime(p, fail_at={2, n // 2 + 2, n + 2})).run()
    assert loop.restarts == 3
    assert_same_results(loop.history, full.history)
    assert same(client_states(loop), client_states(full))


def test_a_host_saves_the_clients_encoded_anew_and_loads_a_chain_of_saves_in_order():
    """save(False) holds just the clients that trained since the save before, even when a checkpoint's
    state() encoded them in between; loading saves oldest first gives each client its latest blob."""
    p = prepare(cfg_for("local"))
    rt = LocalRuntime(p, n_hosts=1)
    host = rt.hosts[0]
    base = host.save(True)
    assert set(base) == set(host.clients) == {0, 1, 2, 3}
    rt.call("train", {0: {}, 2: {}})
    first = host.save(False)
    assert set(first) == {0, 2}
    rt.call("train", {1: {}})
    host.state()  # a checkpoint
    second = host.save(False)
    assert set(second) == {1} and host.save(False) == {}
    latest = host.state()
    for checkpoint in (False, True):  # moves on (encoded by a checkpoint or not); the chain takes it back
        rt.call("train", {0: {}, 3: {}})
        if checkpoint:
            host.state()
        host.load_state(base, first, second)
        assert host.save(False) == {}  # what was loaded is what the chain holds
        assert host.state() == latest == {**base, **first, **second}
    for cid in (0, 3):
        np.testing.assert_array_equal(np.asarray(host.clients[cid].weights()), snapshot.loads(latest[cid])["model"])


def test_a_restored_snapshot_is_the_chain_the_next_saves_extend():
    """After a restore, saves go on from the restored snapshot, not from saves made after it (which may have
    died with their actor)."""
    p = prepare(cfg_for("local"))
    rt = LocalRuntime(p, n_hosts=2)
    first = rt.save_clients()
    rt.call("train", {0: {}, 3: {}})
    rt.save_clients()
    rt.restore_clients(first)
    rt.call("train", {1: {}})
    after = rt.save_clients()
    assert after[:-1] == first and [set(part) for part in after[-1]] == [{1}, set()]


class Crash(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round(self, loop, record):
        if record.step == self.at:
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_every_algorithm_resumes_from_its_checkpoint(algo, tmp_path):
    """Server state_dict and client state (model, personal state, optimizer, RNGs) through a checkpoint file:
    the resumed run ends where the uninterrupted one does."""
    cfg = cfg_for(algo, checkpoint_every=1)
    p = prepare(cfg)
    full = Loop(p, LocalRuntime(p)).run()
    last = len(full.history) - 1
    with pytest.raises(RuntimeError, match="simulated"):
        Loop(p, LocalRuntime(p), [Crash(last - 1)], checkpoint_dir=str(tmp_path)).run()
    resumed = Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path)).run()
    assert resumed.start_step == last - 1  # the crash came before that round was checkpointed
    assert_same_results(resumed.history, full.history)
    assert same(client_states(resumed), client_states(full))


def test_too_many_client_faults_end_the_run_naming_the_cause():
    p = prepare(cfg_for("fedavg", max_restarts=1))
    with pytest.raises(ClientsLost, match=r"died 2 times, more than max_restarts=1; last: host 0 lost"):
        Loop(p, FaultyRuntime(p, fail_at={2, 3})).run()


# --------------------------------------------------------------------------------------------------
# checkpoints: refused when not this config's or this version's, and never unpickled
# --------------------------------------------------------------------------------------------------
def _checkpoint(tmp_path, **kw):
    cfg = tiny(algo="fedavg", rounds=2, checkpoint_every=1, **kw)
    p = prepare(cfg)
    Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path)).run()
    return cfg, snapshot.load(os.path.join(tmp_path, CHECKPOINT_FILE))


def test_a_checkpoint_with_a_pickle_payload_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    cfg, state = _checkpoint(tmp_path / "run")
    p = prepare(cfg)
    run_dir = tmp_path / "run"
    path = run_dir / CHECKPOINT_FILE

    # 1. a client's state replaced by a pickle (what torch.save writes) inside a valid checkpoint
    buf = io.BytesIO()
    torch.save({"model": Payload(marker)}, buf)
    state["clients"][0] = buf.getvalue()
    snapshot.save(str(path), state)
    with pytest.raises(UserError, match=r"checkpoint=.*unreadable"):
        Loop(p, LocalRuntime(p), checkpoint_dir=str(run_dir)).run()
    # 2. the whole checkpoint a pickle, under the new name and under the old one
    for name in (CHECKPOINT_FILE, "checkpoint.pkl"):
        os.remove(path) if path.exists() else None
        with open(run_dir / name, "wb") as f:
            pickle.dump({"step": 0, "server": Payload(marker)}, f)
        assert Loop.has_checkpoint(str(run_dir))
        with pytest.raises(UserError, match="checkpoint=") as e:
            Loop(p, LocalRuntime(p), checkpoint_dir=str(run_dir)).run()
        assert "\n" not in str(e.value)
        os.remove(run_dir / name)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()  # the payload was live


def test_a_checkpoint_of_another_config_or_version_is_refused(tmp_path, monkeypatch):
    cfg, _ = _checkpoint(tmp_path)
    other = tiny(algo="fedavg", rounds=2, checkpoint_every=1, lr=0.2)
    p = prepare(other)
    with pytest.raises(UserError, match=r"checkpoint=.*another config \(lr was 0.1, now 0.2\)"):
        Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path)).run()
    # what does not change results may change: resources, where things are kept, how often
    same = tiny(algo="fedavg", rounds=2, checkpoint_every=2, clients_per_actor=3, experiment="elsewhere")
    assert Loop.read_checkpoint(str(tmp_path), same)["step"] == 1
    import rayfl

    monkeypatch.setattr(rayfl, "__version__", "99.0")
    with pytest.raises(UserError, match=r"written by rayfl 0\.\d+\.\d+, this is rayfl 99.0"):
        Loop.read_checkpoint(str(tmp_path), cfg)


def test_has_checkpoint():
    assert not Loop.has_checkpoint("/nonexistent")


# --------------------------------------------------------------------------------------------------
# under Ray: kill a client actor's process, kill the driver's
# --------------------------------------------------------------------------------------------------
def launch_run(cfg, uri, name, on_round=None, **kw):
    from rayfl.actors.launch import launch

    exp = ensure_experiment(uri, "faults")
    return launch(prepare(cfg), {"tracking_uri": uri, "experiment_id": exp, "run_name": name},
                  on_round=on_round, poll_seconds=0.02, **kw)


FAULT_CFG = dict(algo="fedfomo", rounds=4, clients=4, clients_per_actor=2, params={"M": 2}, participation=0.75)


@pytest.fixture(scope="module")
def clean(ray_session, tmp_path_factory):
    """The uninterrupted run on Ray that the runs with faults must equal."""
    return launch_run(tiny(**FAULT_CFG), f"sqlite:///{tmp_path_factory.mktemp('clean')}/mlflow.db", "clean")


def actor_killer(step: int = 1):
    """(on_event, on_round, killed): callbacks that SIGKILL the run's first client actor once round ``step`` is
    reported (its pid from the placement the driver reports when the loop starts), and the pids killed."""
    killed, pids = [], []

    def start(event):
        if event["event"] == "start":
            pids.extend(a["pid"] for a in event["placement"])

    def kill(rec):
        if rec["step"] == step and not killed:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    return start, kill, killed


def test_a_killed_client_actor_is_restarted_and_the_run_ends_as_if_nothing_happened(clean, mlflow_uri, capfd):
    cfg = tiny(**FAULT_CFG)
    start, kill, killed = actor_killer()
    result = launch_run(cfg, mlflow_uri, "client-kill", on_round=kill, on_event=start)
    assert killed and result["client_restarts"] == 1
    assert_same_results(result["history"], clean["history"])
    run = MlflowClient(mlflow_uri).get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rayfl.client_restarts"] == "1"
    assert run.data.metrics["client_restarts"] == 1
    assert "client actor lost in round" in capfd.readouterr().err


def test_a_killed_driver_is_replaced_and_finishes_the_same_mlflow_run(clean, mlflow_uri, tmp_path):
    cfg = tiny(**FAULT_CFG, checkpoint_every=1)
    killed, seen = [], []

    def kill(rec):
        seen.append(rec["step"])
        if rec["step"] == 1 and not killed:
            os.kill(rec["driver_pid"], signal.SIGKILL)
            killed.append(rec["driver_pid"])

    result = launch_run(cfg, mlflow_uri, "driver-kill", on_round=kill, checkpoint_dir=str(tmp_path))
    steps = list(range(len(clean["history"])))
    assert killed and seen == steps  # each round shown once
    assert_same_results(result["history"], clean["history"])
    client = MlflowClient(mlflow_uri)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rayfl.driver_restarts"] == "1"
    assert len(client.search_runs([run.info.experiment_id], "attributes.run_name = 'driver-kill'")) == 1
    assert {m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")} == {s + 1 for s in steps}  # MLflow steps are rounds


def test_a_driver_that_keeps_dying_closes_its_mlflow_run_as_failed(ray_session, mlflow_uri, tmp_path):
    from rayfl.actors.launch import DriverLost

    cfg = tiny(**FAULT_CFG, max_restarts=0)

    def kill(rec):
        if rec["step"] == 0:
            os.kill(rec["driver_pid"], signal.SIGKILL)

    with pytest.raises(DriverLost, match="max_restarts=0"):
        launch_run(cfg, mlflow_uri, "driver-dies", on_round=kill, checkpoint_dir=str(tmp_path))
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([ensure_experiment(mlflow_uri, "faults")], "attributes.run_name = 'driver-dies'")[0]
    assert run.info.status == "FAILED"
