"""Differential privacy (rayfl.privacy): DP-SGD's clipping, noise and Poisson batches against hand computations,
the accountant against Opacus's called directly, user-level clipping in the reduction, refusals before Ray
starts, and the same ε after a replayed client actor, a resumed run and a killed actor on Ray."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import same, tiny
from rayfl import privacy, training
from rayfl.cli import main
from rayfl.client import Client, TrainSettings
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.privacy import Account, DPSettings
from rayfl.reduce import ClippedSum, reduce_uploads
from rayfl.runtime import LocalRuntime
from test_faults import Crash, FaultyRuntime, actor_killer, assert_same_results, client_states, launch_run


def account(noise=1.0, clip=1.0, delta=1e-5, kind="rdp"):
    return Account(DPSettings(noise, clip, delta, "sample", kind), SimpleNamespace(state={}))


def flat_mlp(seed=0, d=5, k=3):
    torch.manual_seed(seed)
    return training.flatten(nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, k)))


def data(n=40, d=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


# --------------------------------------------------------------------------------------------------
# accounting
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_epsilon_of_a_clients_training_is_opacus_accountant_called_directly(kind):
    """A client trains 3 epochs of 40 samples in batches of 16: q = 16/40, 3 steps an epoch (as plain training);
    its history and ε at δ are what Opacus's accountant gives for 9 steps at (σ, q)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    x, y = data()
    model = flat_mlp()
    acc = account(noise=1.3, kind=kind)
    privacy.train_epochs(model, x, y, 3, 16, training.FlatSGD(model, 0.1), nn.functional.cross_entropy,
                         torch.Generator().manual_seed(0), acc)
    history = acc.client.state[privacy.HISTORY]
    assert history == [[1.3, 0.4, 9]]
    ref = RDPAccountant() if kind == "rdp" else PRVAccountant()
    for _ in range(9):
        ref.step(noise_multiplier=1.3, sample_rate=16 / 40)
    assert privacy.epsilon(history, 1e-5, kind) == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-9)
    # a second stage at another rate composes with the first, as one accountant over both
    privacy.spend(history, 1.3, 0.5, 4, kind)
    for _ in range(4):
        ref.step(noise_multiplier=1.3, sample_rate=0.5)
    assert history == [[1.3, 0.4, 9], [1.3, 0.5, 4]]
    assert privacy.epsilon(history, 1e-5, kind) == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-9)


def test_epsilon_grows_every_round_and_lands_in_every_clients_record():
    p = prepare(tiny(algo="fedavg", rounds=3, dp_noise=1.0))
    loop = Loop(p, LocalRuntime(p)).run()
    eps = [h["dp_epsilon_max"] for h in loop.history]
    assert eps[0] > 0 and all(b > a for a, b in zip(eps, eps[1:]))
    assert all(h["dp_epsilon_mean"] <= h["dp_epsilon_max"] for h in loop.history)
    assert {rec["dp_epsilon"] for rec in loop.last_eval.values()} == {loop.final["dp_epsilon_max"]}  # equal sizes
    plain = prepare(tiny(algo="fedavg", rounds=3))
    assert "dp_epsilon_max" not in Loop(plain, LocalRuntime(plain)).run().final


# --------------------------------------------------------------------------------------------------
# DP-SGD: clipping, noise, batches
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_no_noise_and_a_huge_clip_train_like_plain_sgd_on_the_same_poisson_batches(momentum):
    """σ = 0, C = 1e9: the private path is SGD on the Poisson batches, each batch's summed loss over the expected
    batch size q·n (Opacus's mean reduction), here with torch's SGD on an unflattened copy of the model."""
    x, y = data()
    model = flat_mlp()
    ref = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    private_loss = privacy.train_epochs(model, x, y, 2, 16, training.FlatSGD(model, 0.2, momentum),
                                        nn.functional.cross_entropy, torch.Generator().manual_seed(7),
                                        account(noise=0.0, clip=1e9))
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=momentum)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2 * 3):  # 3 steps an epoch: ceil(40 / 16)
        idx = torch.nonzero(torch.rand(40, generator=gen) < 16 / 40).squeeze(1)  # each sample in with prob. q
        opt.zero_grad()
        losses = nn.functional.cross_entropy(ref(x[idx]), y[idx], reduction="none")
        (losses.sum() / 16).backward()
        opt.step()
    np.testing.assert_allclose(training.to_vector(model), training.to_vector(ref), atol=1e-6)
    assert np.isfinite(private_loss)


def test_the_update_from_noise_alone_has_standard_deviation_sigma_c_over_the_batch():
    """A loss with zero gradient: one step (q = 1, 64 samples) with lr 1 moves every weight by -N(0, σC)/64."""
    torch.manual_seed(0)
    model = training.flatten(nn.Sequential(nn.Linear(100, 100)))
    before = training.to_vector(model)
    x, y = torch.randn(64, 100), torch.zeros(64, dtype=torch.long)
    privacy.train_epochs(model, x, y, 1, 64, training.FlatSGD(model, 1.0), lambda out, _: out.sum() * 0.0,
                         torch.Generator().manual_seed(1), account(noise=2.0, clip=0.5))
    step = training.to_vector(model) - before
    assert abs(step.mean()) < 3 * (2.0 * 0.5 / 64) / math.sqrt(step.size)
    assert step.std() == pytest.approx(2.0 * 0.5 / 64, rel=0.03)  # 10,100 draws


def test_per_sample_clipping_bounds_every_samples_gradient():
    """loss_i = w·x_i: sample i's gradient is x_i. Summed after clipping to C = 1: Σ x_i min(1, 1/(‖x_i‖ + 1e-6))."""
    model = nn.Linear(4, 1, bias=False)
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.1, 0.0, 0.2, 0.0], [0.0, 0.0, 0.0, 10.0]])
    y = torch.zeros(3)
    loss_fn = lambda out, _: out.sum()  # noqa: E731
    grads, _ = privacy.per_sample_grads([(model, [model.weight], loss_fn)], x, y)
    np.testing.assert_allclose(grads[0].reshape(3, 4).numpy(), x.numpy(), atol=1e-6)  # the known gradients
    summed, _ = privacy.noisy_gradient([(model, [model.weight], loss_fn)], x, y, 0.0, 1.0, 1.0, None)
    expected = np.zeros(4)
    for row in x.numpy().astype(np.float64):
        expected += row * min(1.0, 1.0 / (np.linalg.norm(row) + 1e-6))
    np.testing.assert_allclose(summed[0].reshape(-1).numpy(), expected, rtol=1e-5)
    for i in range(3):  # each sample alone contributes at most C
        alone, _ = privacy.noisy_gradient([(model, [model.weight], loss_fn)], x[i:i + 1], y[i:i + 1], 0.0, 1.0, 1.0,
                                          None)
        assert float(alone[0].norm()) <= 1.0 + 1e-6


def test_clients_train_privately_only_inside_their_steps_and_charge_their_own_account():
    x, y = data()
    splits = {"train": (x, y), "val": (x[:5], y[:5]), "test": (x[:5], y[:5])}
    dp = DPSettings(1.0, 1.0, 1e-5)
    client = Client(0, splits, lambda: nn.Sequential(nn.Linear(5, 3)), None,
                    TrainSettings("classification", 2, 0.1, 16, dp=dp), seed=0)
    client.fit()  # outside a client step (a host's warm-up): plain training, nothing charged
    assert privacy.HISTORY not in client.state and privacy.client_epsilon(client) == 0.0
    with privacy.training_of(client):
        client.fit()
    assert client.state[privacy.HISTORY] == [[1.0, 0.4, 6]] and privacy.client_epsilon(client) > 0
    assert privacy.active() is None


# --------------------------------------------------------------------------------------------------
# user level
# --------------------------------------------------------------------------------------------------
def test_user_level_clipping_bounds_each_clients_contribution_to_the_sum():
    start = np.array([1.0, 1.0, 1.0], np.float32)
    ups = {0: {"weights": np.array([4.0, 5.0, 1.0], np.float32), "n": 10},  # update (3, 4, 0): norm 5 -> 2
           1: {"weights": np.array([1.0, 2.0, 1.0], np.float32), "n": 90},  # update (0, 1, 0): kept
           2: {"train_loss": 0.1, "n": 5}}  # no upload to sum
    out = reduce_uploads(ClippedSum("weights", start, 2.0), ups)
    np.testing.assert_allclose(out.reduced["weights"], [3 * 2 / 5, 4 * 2 / 5 + 1.0, 0.0], rtol=1e-12)
    assert all("weights" not in u for u in out.values())  # the driver never sees a client's vector
    for c in (0, 1):
        alone = reduce_uploads(ClippedSum("weights", start, 2.0), {c: dict(ups[c])}).reduced["weights"]
        assert np.linalg.norm(alone) <= 2.0 + 1e-12
    assert reduce_uploads(ClippedSum("weights", start, 2.0), {2: ups[2]}).reduced["weights"] is None


def test_user_level_average_adds_the_noise_once_over_the_fixed_denominator():
    start, total = np.ones(4, np.float32), np.array([0.5, -1.0, 0.0, 2.0])
    dp = DPSettings(1.5, 2.0, 1e-5, "user")
    got = privacy.user_level_average(total, start, dp, 0.5, 8, np.random.default_rng(3))
    noise = np.random.default_rng(3).normal(0.0, 1.5 * 2.0, size=4)
    np.testing.assert_allclose(got, 1.0 + (total + noise) / (0.5 * 8), rtol=1e-6)
    empty = privacy.user_level_average(None, start, dp, 0.5, 8, np.random.default_rng(3))  # nobody sampled
    np.testing.assert_allclose(empty, 1.0 + noise / 4, rtol=1e-6)


def test_user_level_fedavg_samples_users_by_poisson_and_accounts_every_round():
    from opacus.accountants import RDPAccountant

    p = prepare(tiny(algo="fedavg", clients=6, rounds=4, participation=0.5, dp_level="user", dp_noise=1.2,
                     dp_clip=0.5))
    loop = Loop(p, LocalRuntime(p)).run()
    assert loop.dp_history == [[1.2, 0.5, 4]]
    ref = RDPAccountant()
    for _ in range(4):
        ref.step(noise_multiplier=1.2, sample_rate=0.5)
    assert loop.final["dp_epsilon_max"] == pytest.approx(ref.get_epsilon(delta=1e-5))
    assert len({len(h) for h in [loop.sample(loop.server.stages()[0]) for _ in range(20)]}) > 1  # not fixed-size


def test_user_level_refuses_a_grouped_mean_rather_than_average_without_noise():
    from rayfl.reduce import WeightedMean

    p = prepare(tiny(algo="fedavg", clients=4, rounds=1, participation=0.5, dp_level="user", dp_noise=1.0))
    loop = Loop(p, LocalRuntime(p))
    msgs = {c: {"models": {"global": loop.server.global_ref}, "node": c % 2} for c in range(4)}
    with pytest.raises(ValueError, match=r"FedAvgServer: dp_level=user clips and noises one average a call; "
                                         r"a grouped WeightedMean \(group='node'\)"):
        loop.call("train", msgs, reduce=WeightedMean("weights", by="n", group="node"))


# --------------------------------------------------------------------------------------------------
# refusals: one line, exit 2, before Ray starts
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, fragment", [
    (["--dp-noise", "-1"], "dp_noise=-1.0: must be >= 0"),
    (["--dp-noise", "nan"], "dp_noise='nan': must be a finite number"),
    (["--dp-noise", "1", "--dp-clip", "0"], "dp_clip=0.0: must be > 0"),
    (["--dp-noise", "1", "--dp-delta", "0"], "dp_delta=0.0: must be in (0, 1)"),
    (["--dp-noise", "1", "--dp-delta", "1.5"], "dp_delta=1.5: must be in (0, 1)"),
    (["--dp-noise", "1", "--dp-level", "global"], "dp_level='global': unknown; allowed: sample, user"),
    (["--dp-noise", "1", "--dp-accountant", "gdp"], "dp_accountant='gdp': unknown; allowed: rdp, prv"),
    (["--dp-noise", "1", "--algo", "usercentric"], "algo='usercentric': dp_level=sample cannot cover it: its setup"),
    (["--dp-noise", "1", "--algo", "fedfomo", "--dp-level", "user"], "algo='fedfomo': dp_level=user cannot cover"),
    (["--dp-noise", "1", "--algo", "federico", "--dp-level", "user"], "algo='federico': dp_level=user cannot"),
    (["--dp-noise", "1", "--algo", "federico", "--clients", "5", "--val-frac", "0"],
     "val_frac=0.0: under dp_level=sample"),
    (["--dp-noise", "1", "--algo", "fedmoe", "--dp-level", "user", "--participation", "0.5"],
     "dp_level='user' with opt_out=0.0, participation=0.5"),
])
def test_bad_privacy_values_are_one_line_exit_2_before_ray(argv, fragment, capsys, monkeypatch):
    import rayfl.api

    monkeypatch.setattr(rayfl.session, "start_ray", lambda *a: pytest.fail("Ray started"))
    assert main(["run", "--dataset", "synthetic", "--clients", "3", "--rounds", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rayfl: error: {fragment}") and err.count("\n") == 1, err


def test_a_model_with_batchnorm_is_refused_naming_the_layer(monkeypatch):
    from rayfl import models

    bn = lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 8), nn.BatchNorm1d(8),  # noqa: E731
                                        nn.Linear(8, k))
    monkeypatch.setitem(models.MODELS, "bn-mlp", bn)
    from rayfl.experiment import prepare

    with pytest.raises(UserError, match=r"^model='bn-mlp': dp_level=sample cannot train it: layer '2' \(BatchNorm1d\)"):
        prepare(tiny(model="bn-mlp", dp_noise=1.0))
    prepare(tiny(model="bn-mlp"))  # without DP it is a model like any other
    prepare(tiny(model="bn-mlp", dp_noise=1.0, dp_level="user"))  # user level clips whole updates
    model = training.flatten(bn((5,), 3))
    with pytest.raises(ValueError, match=r"layer '2' \(BatchNorm1d\) mixes the samples of a batch"):
        privacy.train_epochs(model, *data(), 1, 16, training.FlatSGD(model, 0.1), nn.functional.cross_entropy,
                             torch.Generator(), account())


def test_a_promise_is_declared_by_the_class_itself_not_inherited():
    from rayfl.algorithms.base import capability, declared
    from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer

    class Trains(FedAvgClient):  # e.g. a baseline that overrides how it trains
        pass

    class Averages(FedAvgServer):
        pass

    assert declared(FedAvgClient, "private_training") is True
    assert declared(Trains, "private_training") is None
    assert declared(Averages, "averages") is None
    assert capability(Trains, "private_training") is None and capability(Trains(None), "local_buffers") is False
    assert capability(FedAvgServer, "averages") == "global_ref" and capability(Averages, "averages") is None


# --------------------------------------------------------------------------------------------------
# faults: the same ε after a replay, a resume, a killed actor
# --------------------------------------------------------------------------------------------------
DP_RUNS = {
    "fedavg": dict(algo="fedavg", participation=0.67, dp_noise=1.0),
    "fedfomo": dict(algo="fedfomo", params={"M": 2}, dp_noise=1.0),
    "federico": dict(algo="federico", partition="label-groups", groups=2, params={"M": 1}, dp_noise=1.0),
    "persfl-user": dict(algo="persfl", params={"lam_grid": [0.0, 0.5], "T_grid": [1.0]}, participation=0.5,
                        dp_level="user", dp_noise=1.0),
}


@pytest.mark.parametrize("run", sorted(DP_RUNS))
def test_a_replayed_client_actor_reports_the_same_epsilon(run):
    p = prepare(tiny(clients=4, rounds=3, clients_per_actor=2, **DP_RUNS[run]))
    full = Loop(p, FaultyRuntime(p)).run()
    n = full.runtime.calls
    loop = Loop(p, FaultyRuntime(p, fail_at={2, n // 2 + 2, n + 2})).run()
    assert loop.restarts == 3
    assert_same_results(loop.history, full.history)  # dp_epsilon_max / _mean round by round
    assert loop.final["dp_epsilon_max"] > 0 and loop.dp_history == full.dp_history
    assert same(client_states(loop), client_states(full))  # every client's accountant history


@pytest.mark.parametrize("run", ["fedavg", "persfl-user"])
def test_a_resumed_run_reports_the_same_epsilon(run, tmp_path):
    p = prepare(tiny(clients=4, rounds=3, checkpoint_every=1, **DP_RUNS[run]))
    full = Loop(p, LocalRuntime(p)).run()
    last = len(full.history) - 1
    with pytest.raises(RuntimeError, match="simulated"):
        Loop(p, LocalRuntime(p), [Crash(last - 1)], checkpoint_dir=str(tmp_path)).run()
    resumed = Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path)).run()
    assert resumed.start_step == last - 1
    assert_same_results(resumed.history, full.history)
    assert resumed.final["dp_epsilon_max"] == full.final["dp_epsilon_max"] > 0


def test_on_ray_a_killed_client_actor_changes_no_epsilon_and_mlflow_says_the_run_is_private(ray_session, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = dict(algo="fedavg", rounds=3, clients=4, clients_per_actor=2, participation=0.75, dp_noise=1.0,
               dp_clip=0.8)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    clean = launch_run(tiny(**cfg), uri, "clean")
    start, kill, killed = actor_killer()
    result = launch_run(tiny(**cfg), uri, "client-kill", on_round=kill, on_event=start)
    assert killed and result["client_restarts"] == 1
    assert_same_results(result["history"], clean["history"])
    client = MlflowClient(uri)
    run = client.get_run(result["run_id"])
    tags = run.data.tags
    assert (tags["rayfl.dp.noise"], tags["rayfl.dp.clip"], tags["rayfl.dp.delta"], tags["rayfl.dp.level"],
            tags["rayfl.dp.accountant"]) == ("1.0", "0.8", "1e-05", "sample", "rdp")
    assert run.info.run_name == "DP σ=1 client-kill"  # the mark first: a narrow runs-table column still shows it
    eps = result["final"]["dp_epsilon_max"]
    assert tags["rayfl.dp.epsilon"] == f"{eps:.6g}" and float(tags["rayfl.dp.epsilon"]) > 0
    assert "plots/accuracy.png" in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert f"ε={eps:.3g} at δ=1e-05" in tags["mlflow.note.content"]
    final = json.loads(open(client.download_artifacts(run.info.run_id, "results/final.json")).read())
    assert final["dp_epsilon_max"] == eps and final["dp_epsilon_mean"] == result["final"]["dp_epsilon_mean"]
    table = open(client.download_artifacts(run.info.run_id, "results/clients/round_0003.csv")).read()
    assert "dp_epsilon" in table.splitlines()[0]


def test_which_algorithms_each_level_covers():
    """Every registered algorithm either takes DP at a level or is refused with one line saying why."""
    from rayfl.algorithms import algorithm_names
    from test_faults import ALGOS

    covered = {"sample": set(), "user": set()}
    for level in covered:
        for algo in algorithm_names():
            try:
                tiny(algo=algo, dp_noise=1.0, dp_level=level, **ALGOS[algo]).check()
                covered[level].add(algo)
            except UserError as e:
                assert str(e).startswith((f"algo={algo!r}: dp_level={level} cannot cover it",  # or a setting of it
                                          f"dp_level={level!r} with ")), str(e)
    assert covered["sample"] == {"local", "fedavg", "fedavg-ft", "fedfomo", "persfl", "federico", "fedmoe", "fedprox",
                                 "fedavg-data", "oracle", "lg-fedavg", "fedper", "mocha", "cfl"}
    assert covered["user"] == {"fedavg", "fedavg-ft", "persfl", "fedprox", "fedavg-data"}
