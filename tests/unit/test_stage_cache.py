"""Stage reuse (rayfl.stage_cache): a run that restores a stored stage equals one that computes it, to the
last metric; a changed upstream value misses the cache, a knob that only later stages read hits it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import tiny
from rayfl.algorithms.base import Stage
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime
from rayfl.stage_cache import Lock, stage_keys

PERSFL = {"algo": "persfl", "partition": "pathological", "clients": 4, "rounds": 3, "samples_per_client": 150}


def run(cache=None, **values):
    cfg = tiny(**{**values, "stage_cache": str(cache) if cache else ""})
    p = prepare(cfg)
    return Loop(p, LocalRuntime(p)).run()


def persfl(cache=None, params=None, **values):
    return run(cache, **{**PERSFL, **values, "params": {"lam_grid": (0.0, 0.5), "T_grid": (1.0, 4.0),
                                                        **(params or {})}})


def reused(loop):
    return loop.stage_reuse.reused[0] if loop.stage_reuse and loop.stage_reuse.reused else None


def same_to_the_last_metric(a, b):
    """Every round's metrics but wall times, every client's last evaluation, and the algorithm's tables."""
    strip = lambda h: [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in h]  # noqa: E731
    assert strip(a.history) == strip(b.history)
    ev = lambda loop: {c: {k: v for k, v in r.items() if k != "seconds"} for c, r in loop.last_eval.items()}  # noqa: E731
    assert ev(a) == ev(b)
    for name, obj in a.server.artifacts().items():
        other = b.server.artifacts()[name]
        assert obj.equals(other) if hasattr(obj, "equals") else np.array_equal(obj, other), name


# ------------------------------------------------------------------------------------------- keys
def keys(algo="persfl", params=None, data="d", version="v", stages=None, **cfg_values):
    from rayfl.algorithms import get_algorithm

    cfg = tiny(algo=algo, **cfg_values)
    p = get_algorithm(algo).make_params(params or {})
    stages = stages or [Stage("fedavg", cfg.rounds, depends_on=()), Stage("distill", 1, sample=False)]
    return stage_keys(cfg, p, stages, data, version)


def test_key_of_a_stage_ignores_only_what_later_stages_read():
    k = keys()
    assert keys(params={"lam": 0.9, "T": 7.0, "teacher": "final"})[0] == k[0]  # stage-2 knobs: stage 1 shared
    assert keys(params={"lam": 0.9})[1] != k[1]
    for changed in (keys(lr=0.2), keys(seed=1), keys(rounds=3), keys(val_frac=0.3), keys(data="e"),
                    keys(version="w"), keys(algo="fedavg-ft", stages=None)):
        assert changed[0] != k[0]
    # what does not change the computation: names, paths, resources
    assert keys(run_name="x", experiment="e", out_dir="/o", clients_per_actor=2, checkpoint_every=3) == k


def test_undeclared_stage_depends_on_every_knob():
    stages = [Stage("a", 2), Stage("b", 1)]
    assert keys(stages=stages, params={"lam": 0.9})[0] != keys(stages=stages)[0]


def test_fedmoe_stages_share_up_to_the_first_knob_that_differs():
    from rayfl.algorithms.fedmoe import FedMoEServer

    def fedmoe_keys(**params):
        from rayfl.algorithms import get_algorithm

        cfg = tiny(algo="fedmoe")
        algo = get_algorithm("fedmoe")
        p = prepare(cfg)
        server = FedMoEServer(algo.make_params(params), p.info, lambda x: x, list, np.random.default_rng(0),
                              p.initial)
        return stage_keys(cfg, server.params, server.stages(), "d", "v")

    base = fedmoe_keys()
    gate = fedmoe_keys(gate_epochs=7)
    assert gate[:2] == base[:2] and gate[2] != base[2]
    spec = fedmoe_keys(specialist_epochs=7)
    assert spec[0] == base[0] and spec[1] != base[1]
    assert fedmoe_keys(opt_out=0.5)[0] != base[0]


# ------------------------------------------------------------------------------------------- whole runs
def test_persfl_reuse_equals_a_run_without_it(tmp_path):
    plain = persfl()
    writer = persfl(tmp_path)
    reader = persfl(tmp_path)
    assert reused(writer) is None and reused(reader) == "fedavg"
    assert reader.start_step == 3  # three FedAvg rounds restored, only the distillation computed
    assert len(os.listdir(tmp_path)) == 1  # one entry (and no lock left behind)
    same_to_the_last_metric(plain, writer)
    same_to_the_last_metric(plain, reader)


def test_downstream_knob_hits_upstream_values_miss(tmp_path):
    persfl(tmp_path)
    one_point = {"lam": 0.5, "T": 4.0, "lam_grid": (), "T_grid": ()}
    hit = persfl(tmp_path, params=one_point)
    assert reused(hit) == "fedavg"
    same_to_the_last_metric(persfl(params=one_point), hit)
    for upstream in ({"lr": 0.2}, {"seed": 1}, {"rounds": 2}):
        assert reused(persfl(tmp_path, **upstream)) is None, upstream
    assert len(os.listdir(tmp_path)) == 4


def test_fedavg_ft_shares_its_fedavg_stage(tmp_path):
    base = {"algo": "fedavg-ft", "rounds": 3}
    run(tmp_path, **base, params={"ft_epochs": 1})
    hit = run(tmp_path, **base, params={"ft_epochs": 2})
    assert reused(hit) == "fedavg"
    same_to_the_last_metric(run(**base, params={"ft_epochs": 2}), hit)


def test_fedmoe_shares_fedavg_and_specialist(tmp_path):
    base = {"algo": "fedmoe", "rounds": 2, "params": {"specialist_epochs": 2, "gate_epochs": 2, "patience": 1}}
    run(tmp_path, **base)
    gate = {**base, "params": {**base["params"], "gate_epochs": 3}}
    hit = run(tmp_path, **gate)
    assert reused(hit) == "specialist" and hit.start_step == 3
    same_to_the_last_metric(run(**gate), hit)
    spec = {**base, "params": {**base["params"], "specialist_epochs": 3}}
    assert reused(run(tmp_path, **spec)) == "fedavg"


def test_off_by_default_and_single_stage_runs_store_nothing(tmp_path):
    assert persfl().stage_reuse is None
    run(tmp_path, algo="fedavg")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------- the lock
def test_lock_one_owner_and_dead_owner_taken_over(tmp_path):
    path = str(tmp_path / "k.lock")
    a, b = Lock(path, poll=0.01), Lock(path, poll=0.01)
    assert a.acquire(lambda: False)
    with open(a.path, "w") as f:  # held by another live process (our parent)
        f.write(f"{os.uname().nodename} {os.getppid()}")
    calls = []
    assert not b.acquire(lambda: calls.append(1) or len(calls) > 2)  # waits until ready, never owns
    with open(a.path, "w") as f:  # a lock left by a process that is gone
        f.write(f"{os.uname().nodename} 999999999")
    assert b.acquire(lambda: False)
    b.release()
    assert not os.path.exists(path)


def test_bad_stage_cache_is_a_user_error(tmp_path):
    from rayfl.config import UserError

    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(UserError, match="stage_cache="):
        tiny(stage_cache=str(f)).check()
