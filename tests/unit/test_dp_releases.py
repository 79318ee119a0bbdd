"""Every private release draws its own Poisson batches and noise (rayfl.privacy.Account.generator): PersFL's grid
points, FedMoE's epochs and every stage and round of a run see different batches and noise, a grid point run
alone equals that point in the grid, and ε is what it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny
from rayfl import privacy
from rayfl.client import Client, TrainSettings
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.privacy import DPSettings
from rayfl.runtime import LocalRuntime


def recorded(monkeypatch) -> dict:
    """Each release's generator -> (client, step name, label, its batches, its noise draws), from the private
    path's own calls."""
    seen: dict = {}
    batch, noise = privacy.poisson_batch, privacy.gaussian_noise

    def entry(gen):
        account = privacy.active()
        return seen.setdefault(gen, (account.client.cid, account.step_name, account.label, [], []))

    def poisson(n, rate, gen, device):
        idx = batch(n, rate, gen, device)
        entry(gen)[3].append(tuple(idx.tolist()))
        return idx

    def gaussian(count, gen, device):
        z = noise(count, gen, device)
        entry(gen)[4].append(tuple(z[:8].tolist()))
        return z

    monkeypatch.setattr(privacy, "poisson_batch", poisson)
    monkeypatch.setattr(privacy, "gaussian_noise", gaussian)
    return seen


def persfl(**params):
    params = {"lam_grid": (0.0, 0.5, 1.0), "T_grid": (1.0, 4.0), **params}
    cfg = make_config(None, {"algo": "persfl", "dataset": "synthetic", "partition": "pathological", "clients": 3,
                             "rounds": 2, "lr": 0.1, "samples_per_client": 80, "batch_size": 16, "dp_noise": 1.0,
                             "params": params})
    p = prepare(cfg)
    return Loop(p, LocalRuntime(p)).run()


def test_persfl_students_and_stages_draw_different_batches_and_noise(monkeypatch):
    seen = recorded(monkeypatch)
    loop = persfl()
    releases = list(seen.values())
    # no two releases of the run (any client, stage, round, grid point) share their batches or their noise
    assert len({tuple(r[3]) for r in releases}) == len(releases)
    assert len({tuple(r[4]) for r in releases}) == len(releases)
    for cid in range(3):
        students = [r for r in releases if r[0] == cid and r[1] == "distill"]
        # λ = 0 is one student whatever T; λ > 0 a student per (λ, T): 1 + 2·2
        assert sorted(r[2] for r in students) == sorted([("grid", 0.0, 0.0), ("grid", 0.5, 1.0), ("grid", 0.5, 4.0),
                                                         ("grid", 1.0, 1.0), ("grid", 1.0, 4.0)])
        assert sum(r[0] == cid and r[1] == "train" for r in releases) == 2  # a FedAvg release per round
    assert loop.final["dp_epsilon_max"] > 0


def test_a_grid_point_run_alone_equals_that_point_in_the_private_grid():
    grid = persfl()
    single = persfl(lam=0.5, T=4.0, lam_grid=(), T_grid=())
    table = grid.server.artifacts()["persfl_grid"]
    want = table[(table.lam == 0.5) & (table["T"] == 4.0)].val_acc.to_numpy()
    np.testing.assert_array_equal(single.server.artifacts()["persfl_clients"].val_acc.to_numpy(), want)


def test_fedmoe_epochs_in_one_client_step_draw_different_batches_and_noise(monkeypatch):
    seen = recorded(monkeypatch)
    p = prepare(tiny(algo="fedmoe", rounds=2, dp_noise=1.0, params={"specialist_epochs": 3, "gate_epochs": 3,
                                                                    "patience": 5}))
    Loop(p, LocalRuntime(p)).run()
    releases = list(seen.values())
    specialist = [r for r in releases if r[0] == 0 and r[1] == "specialist"]
    assert len(specialist) == 3  # an epoch a release, in one client step
    assert len({tuple(r[3]) for r in releases}) == len(releases)
    assert len({tuple(r[4]) for r in releases}) == len(releases)


def test_two_models_trained_in_one_step_from_the_same_generator_state_get_different_releases():
    """Whatever generator the caller passes (here the same seed twice), each private call draws its own."""
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))
    splits = {"train": (x, y), "val": (x[:5], y[:5]), "test": (x[:5], y[:5])}
    client = Client(0, splits, lambda: nn.Sequential(nn.Linear(5, 3)), None,
                    TrainSettings("classification", 1, 0.1, 16, dp=DPSettings(1.0, 1.0, 1e-5)), seed=0)
    moved = []
    with privacy.training_of(client, "train"):
        for _ in range(2):
            torch.manual_seed(3)
            model = client.new_model()  # the same start both times
            start = model[0].weight.detach().clone()
            client.gen.manual_seed(7)  # the caller's generator in the same state both times
            client.fit(model)
            moved.append(model[0].weight.detach() - start)
    assert not torch.allclose(moved[0], moved[1])
    assert client.state[privacy.HISTORY] == [[1.0, 0.4, 6]]  # both charged: 2 x 3 steps at q = 16/40


def test_a_release_is_keyed_by_seed_client_step_label_and_count():
    draw = lambda *key: torch.randn(4, generator=privacy.release_generator(*key))  # noqa: E731
    base = draw(0, 1, "distill", 3, ("grid", 0.5, 1.0), 0)
    assert torch.equal(base, draw(0, 1, "distill", 3, ("grid", 0.5, 1.0), 0))  # a replay redraws its own
    for other in [(1, 1, "distill", 3, ("grid", 0.5, 1.0), 0), (0, 2, "distill", 3, ("grid", 0.5, 1.0), 0),
                  (0, 1, "train", 3, ("grid", 0.5, 1.0), 0), (0, 1, "distill", 4, ("grid", 0.5, 1.0), 0),
                  (0, 1, "distill", 3, ("grid", 0.5, 4.0), 0), (0, 1, "distill", 3, ("grid", 0.5, 1.0), 1)]:
        assert not torch.equal(base, draw(*other)), other


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_epsilon_is_opacus_accountant_over_every_release(kind):
    """A PersFL run's ε composes its FedAvg releases and every student's, as Opacus's accountant stepped by hand."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    cfg = make_config(None, {"algo": "persfl", "dataset": "synthetic", "partition": "iid", "clients": 2,
                             "rounds": 2, "lr": 0.1, "samples_per_client": 60, "batch_size": 16, "dp_noise": 1.2,
                             "dp_accountant": kind, "params": {"lam_grid": (0.5, 1.0), "T_grid": (2.0,)}})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p)).run()
    n = p.federation.clients[0].train.size
    q, steps = min(1.0, 16 / n), -(-n // 16)
    ref = RDPAccountant() if kind == "rdp" else PRVAccountant()
    for _ in range(steps * (2 + 2)):  # 2 FedAvg rounds + 2 students, one local epoch each
        ref.step(noise_multiplier=1.2, sample_rate=q)
    assert loop.final["dp_epsilon_max"] == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-6)


def test_the_prv_accountant_without_a_finite_answer_is_one_line_naming_rdp():
    """Opacus's PRV accountant returns inf at small noise multipliers (where RDP still bounds ε): a run
    asking for it there fails in one line instead of reporting ε = inf."""
    from opacus.accountants import PRVAccountant

    from rayfl.privacy import epsilon

    acc = PRVAccountant()
    for _ in range(5):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    assert epsilon([(1.0, 0.1, 5)], 1e-5, "prv") == acc.get_epsilon(1e-5)  # within its range: Opacus's number
    with pytest.raises(ValueError) as e:
        epsilon([(0.05, 0.5, 5)], 1e-5, "prv")
    assert str(e.value).startswith("dp_accountant='prv': Opacus's PRV accountant has no finite ε at noise "
                                   "multiplier 0.05") and "use dp_accountant=rdp (ε 1174 here)" in str(e.value)
