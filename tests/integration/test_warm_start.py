"""Actors kept between runs (rayfl.actors.pool): a run of the same placement shape reuses the last run's client
actors and driver, and computes exactly what fresh actors compute (model, client state, RNGs, metrics), also
after another config ran on them and when Ray restarts one of them; a run of another shape gets new actors and
the kept ones are killed."""

from __future__ import annotations

import os
import time

import pytest
import ray
from mlflow.tracking import MlflowClient

from conftest import same, tiny
from test_faults import FAULT_CFG, actor_killer, assert_same_results
from rayfl.actors.launch import launch
from rayfl.actors.pool import ActorPool
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.tracking import ensure_experiment

# FedAvg, and FedFomo (each client keeps its own model and its weights over the others' models: state that a
# reused actor must not carry from one run to the next)
CONFIGS = {"fedavg": dict(algo="fedavg", participation=0.67),
           "fedfomo": dict(algo="fedfomo", params={"M": 2}, participation=0.67)}
SHAPE = dict(rounds=3, clients=4, clients_per_actor=2, checkpoint_every=3)


def run(cfg, pool=None, tracking=None, tmp=None, **kw):
    """(outcome, the run's checkpoint, the pids of its client actors and of its driver)."""
    seen = {}

    def on_event(event):
        if event["event"] == "start":
            seen["clients"] = sorted(a["pid"] for a in event["placement"])
            seen["driver"] = event["driver_pid"]
        if "on_event" in kw:
            kw["on_event"](event)

    directory = str(tmp)
    os.makedirs(directory)
    out = launch(prepare(cfg), tracking, checkpoint_dir=directory, on_event=on_event, pool=pool, poll_seconds=0.02,
                 **{k: v for k, v in kw.items() if k != "on_event"})
    return out, Loop.read_checkpoint(directory, cfg), seen


def computed(checkpoint: dict) -> dict:
    """What a run computed: its model and server state, every client's state, the RNGs, the last evaluation
    (less its wall-clock times)."""
    last_eval = {c: {k: v for k, v in row.items() if not k.endswith("seconds")}
                 for c, row in checkpoint["last_eval"].items()}
    return {**{k: checkpoint[k] for k in ("step", "server", "clients", "rng", "server_rng")}, "last_eval": last_eval}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reused_actors_compute_what_fresh_ones_do(ray_session, tmp_path, name):
    cfg = tiny(**CONFIGS[name], **SHAPE)
    cold, cold_ckpt, cold_pids = run(cfg, tmp=tmp_path / "cold")
    pool = ActorPool()
    try:
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        tracking = {"tracking_uri": uri, "experiment_id": ensure_experiment(uri, "warm"), "run_name": "other"}
        # another run first (another seed, so other data, models and RNG streams), whose actors are kept
        other, other_ckpt, first = run(tiny(**CONFIGS[name], **SHAPE, seed=7), pool, tracking, tmp_path / "other")
        assert pool.clients is not None and pool.driver is not None
        warm, warm_ckpt, second = run(cfg, pool, {**tracking, "run_name": "warm"}, tmp_path / "warm")
        assert second == first and second["clients"] != cold_pids["clients"]  # the same processes, reused
        assert not same(computed(other_ckpt)["clients"], computed(cold_ckpt)["clients"])  # (a run that differs)
        assert same(computed(warm_ckpt), computed(cold_ckpt))  # bit for bit: model, clients, RNGs
        assert_same_results(warm["history"], cold["history"])
        assert warm["final"].keys() == cold["final"].keys()
        assert_same_results([warm["final"]], [cold["final"]])
        # the reused driver tracked the second run in a run of its own, closed as it ended
        client = MlflowClient(uri)
        assert warm["run_id"] != other["run_id"]
        for run_id, run_name in ((other["run_id"], "other"), (warm["run_id"], "warm")):
            assert client.get_run(run_id).info.status == "FINISHED"
            assert client.get_run(run_id).info.run_name == run_name
    finally:
        pool.close()


def test_a_reused_actor_that_ray_restarts_is_set_up_for_the_run_again(ray_session, tmp_path):
    """A kept actor that dies during the next run comes back with its creation arguments (another run's): it is
    given the current run again, restored and replayed, and the run ends as a fresh one does."""
    cfg = tiny(**FAULT_CFG)
    clean, _, _ = run(cfg, tmp=tmp_path / "clean")
    pool = ActorPool()
    try:
        _, _, first = run(tiny(**FAULT_CFG, seed=5), pool, tmp=tmp_path / "other")
        start, kill, killed = actor_killer()
        result, _, second = run(cfg, pool, tmp=tmp_path / "warm", on_event=start, on_round=kill)
        assert second["clients"] == first["clients"] and killed and result["client_restarts"] == 1
        assert_same_results(result["history"], clean["history"])
        assert pool.clients is None  # a run with a restart keeps no actors: they are killed
    finally:
        pool.close()


def test_another_shape_gets_new_actors_and_the_kept_ones_end(ray_session, tmp_path):
    pool = ActorPool()
    try:
        _, _, first = run(tiny(**CONFIGS["fedavg"], **SHAPE), pool, tmp=tmp_path / "a")
        _, _, second = run(tiny(**CONFIGS["fedavg"], **{**SHAPE, "clients_per_actor": 4}), pool, tmp=tmp_path / "b")
        assert len(second["clients"]) == 1 and not set(second["clients"]) & set(first["clients"])
        assert second["driver"] == first["driver"]  # the driver serves any shape
        ray.get(pool.clients.actors[0].__ray_ready__.remote())
        deadline = time.monotonic() + 30
        while any(alive(p) for p in first["clients"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in first["clients"])
        kept = [*second["clients"], second["driver"]]
    finally:
        pool.close()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in kept) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in kept)  # close() ends them


def test_a_ray_the_user_started_stays_up_and_keeps_no_actors(ray_session, tmp_path):
    import rayfl
    from rayfl.session import _Kept

    pids = []
    rayfl.run(**{**CONFIGS["fedavg"], "dataset": "synthetic", "partition": "iid", "clients": 3, "rounds": 1,
                 "samples_per_client": 60}, tracking_uri=f"sqlite:///{tmp_path}/m.db", out_dir=str(tmp_path / "runs"),
              progress=lambda e: pids.extend(a["pid"] for a in e["placement"]) if e["event"] == "start" else None)
    assert ray.is_initialized() and _Kept.pool is None and _Kept.job is None
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not any(alive(p) for p in pids)  # the run's actors ended with it
    rayfl.shutdown()
    assert ray.is_initialized()  # not rayfl's to end
