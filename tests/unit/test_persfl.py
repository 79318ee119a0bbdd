"""PersFL (Divi et al., 2021, §4.1): the distillation loss against a hand computation, per-client teacher selection, the grid's
selection on validation (never test); sharing stage 1 is tests/unit/test_stage_cache.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayfl.algorithms import get_algorithm
from rayfl.algorithms.persfl import PersFLClient, PersFLParams, better, distill_loss
from rayfl.client import Client, TrainSettings
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime


def softmax(z):
    e = [math.exp(v - max(z)) for v in z]
    return [v / sum(e) for v in e]


# ------------------------------------------------------------------------------------------- the loss

def test_loss_against_hand_computation():
    s, t, y, lam, T = [1.0, 2.0, 0.0], [0.0, 1.0, 3.0], 1, 0.25, 2.0
    ce = -math.log(softmax(s)[y])
    ps, pt = softmax([v / T for v in s]), softmax([v / T for v in t])
    kl = sum(q * (math.log(q) - math.log(p)) for p, q in zip(ps, pt))  # KL(teacher || student)
    expect = (1 - lam) * ce + lam * T * T * kl
    got = distill_loss(torch.tensor([s]), torch.tensor([t]), torch.tensor([y]), lam, T)
    assert got.item() == pytest.approx(expect, rel=1e-6)
    # Eq. 7 ("gd"): cross-entropy of the teacher's soft labels against the student's = KL + H(teacher)
    h = -sum(q * math.log(q) for q in pt)
    gd = distill_loss(torch.tensor([s]), torch.tensor([t]), torch.tensor([y]), lam, T, "gd")
    assert gd.item() == pytest.approx((1 - lam) * ce + lam * T * T * (kl + h), rel=1e-6)


def test_loss_averages_over_the_batch_and_vanishes_at_the_teacher():
    s = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 2.0]])
    t = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]])
    y = torch.tensor([1, 2])
    both = distill_loss(s, t, y, 0.5, 3.0)
    each = [distill_loss(s[i:i + 1], t[i:i + 1], y[i:i + 1], 0.5, 3.0) for i in range(2)]
    assert both.item() == pytest.approx((each[0].item() + each[1].item()) / 2, rel=1e-6)  # batchmean, not /C
    # student == teacher: the soft term is 0, only (1-λ)·CE is left
    same = distill_loss(t, t, y, 0.5, 3.0)
    assert same.item() == pytest.approx(0.5 * torch.nn.functional.cross_entropy(t, y).item(), rel=1e-6)
    assert distill_loss(s, t, y, 0.0, 7.0).item() == pytest.approx(torch.nn.functional.cross_entropy(s, y).item())


def test_gd_variant_has_the_same_gradient():
    t = torch.tensor([[0.0, 1.0, 3.0]])
    grads = []
    for variant in ("sgd", "gd"):
        s = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
        distill_loss(s, t, torch.tensor([1]), 0.7, 4.0, variant).backward()
        grads.append(s.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ------------------------------------------------------------------------------------------- teacher selection

class ScriptedClient:
    """Just what PersFLClient.track touches; the validation loss of a model is read from its first weight."""

    def __init__(self, cid, losses):
        self.cid, self.losses, self.state = cid, losses, {}
        self.settings = TrainSettings("classification", 1, 0.1, 8)

    def n(self, split):
        return 5

    def loss_of(self, vec, split):
        assert split == "val"
        return self.losses[int(vec[0])]


def test_teacher_is_per_client_lowest_val_loss_with_strict_improvement():
    logic = PersFLClient(PersFLParams())
    a = ScriptedClient(0, [2.0, 1.5, 0.9, 1.1, 0.9])  # round 2 and 4 tie: the earlier stays
    b = ScriptedClient(1, [2.0, 0.7, 0.8, 0.9, 1.0])  # a different client, a different round
    for c in (a, b):
        logic.init_client(c)
        for r in range(5):
            logic.track(c, np.array([r, 0.0], np.float32), r)
    assert (a.state["teacher_round"], a.state["teacher_loss"]) == (2, 0.9)
    assert (b.state["teacher_round"], b.state["teacher_loss"]) == (1, 0.7)
    np.testing.assert_array_equal(b.state["teacher"], [1.0, 0.0])


# ------------------------------------------------------------------------------------------- grid on validation

def test_better_breaks_ties_towards_the_first_point():
    assert better((0.8, 1.0), None)
    assert better((0.9, 2.0), (0.8, 1.0))
    assert better((0.8, 0.9), (0.8, 1.0))
    assert not better((0.8, 1.0), (0.8, 1.0))
    assert not better((0.7, 0.1), (0.8, 1.0))


def tiny_client(test_labels_flipped=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(90, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    test_y = 1 - y[60:] if test_labels_flipped else y[60:]
    splits = {"train": (x[:30], y[:30]), "val": (x[30:60], y[30:60]), "test": (x[60:], test_y)}
    make = lambda: torch.nn.Linear(4, 2)  # noqa: E731
    teacher = np.random.default_rng(0).normal(0, 0.3, 10).astype(np.float32)
    c = Client(3, splits, make, teacher, TrainSettings("classification", 2, 0.5, 8), 0)
    return c, teacher


def run_distill(params, flipped=False):
    logic = PersFLClient(params)
    client, teacher = tiny_client(flipped)
    logic.init_client(client)
    client.state.update(teacher=teacher, teacher_round=4, teacher_loss=0.5)
    return logic.step_distill(client, {"seed": 0}, {}), client


def test_grid_selects_on_validation_never_test():
    params = PersFLParams(lam_grid=(0.0, 0.5, 1.0), T_grid=(1.0, 5.0))
    up, client = run_distill(params)
    grid = up["grid"]
    assert [(g[0], g[1]) for g in grid] == params.grid()
    best = max(range(len(grid)), key=lambda i: (grid[i][2], -grid[i][3], -i))  # val acc, val loss, first
    assert (up["lam"], up["T"]) == tuple(grid[best][:2])
    assert grid[0][2:] == grid[1][2:]  # λ = 0: T plays no role
    loss, acc = client.loss(client.model), client.evaluate(client.model)["val_acc"]
    assert (acc, loss) == pytest.approx((up["val_acc"], up["val_loss"]))  # the kept model is the chosen one
    flipped, _ = run_distill(params, flipped=True)  # the test split's labels cannot change the choice
    assert (flipped["lam"], flipped["T"], flipped["grid"]) == (up["lam"], up["T"], up["grid"])


def test_single_point_equals_that_point_of_the_grid():
    grid_up, _ = run_distill(PersFLParams(lam_grid=(0.0, 0.5), T_grid=(1.0, 5.0)))
    one, client = run_distill(PersFLParams(lam=0.5, T=5.0, lam_grid=(), T_grid=()))
    assert (one["lam"], one["T"]) == (0.5, 5.0)
    assert one["grid"] == [g for g in grid_up["grid"] if (g[0], g[1]) == (0.5, 5.0)]


def test_params_from_cli_strings_and_checks():
    algo = get_algorithm("persfl")
    p = algo.make_params({"lam_grid": "0,0.5", "T_grid": "1,3", "lam": "0.2", "variant": "gd"})
    assert p.lam_grid == (0.0, 0.5) and p.T_grid == (1.0, 3.0) and p.lam == 0.2
    assert algo.make_params({"lam_grid": [], "T_grid": []}).grid() == [(0.5, 1.0)]
    for bad in (dict(lam=1.5), dict(T_grid=(0.0,)), dict(variant="kd"), dict(teacher="worst"),
                dict(distill_epochs=-1)):
        with pytest.raises(ValueError):
            PersFLParams(**bad).check(4)


# ------------------------------------------------------------------------------------------- whole runs

def run(**params):
    params = {"lam_grid": (0.0, 0.5), "T_grid": (1.0, 4.0), **params}
    cfg = make_config(None, {"algo": "persfl", "dataset": "synthetic", "partition": "pathological", "clients": 4,
                             "rounds": 3, "lr": 0.1, "samples_per_client": 150, "params": params})
    p = prepare(cfg)
    return Loop(p, LocalRuntime(p)).run()


def test_whole_run_tables_and_one_point_equals_that_point_of_the_grid():
    """(Sharing stage 1 across runs is the platform's: tests/unit/test_stage_cache.py.)"""
    plain = run()
    assert [h["stage"] for h in plain.history] == ["fedavg"] * 3 + ["distill"]
    # FedAvg rounds train and average; only the distillation round picks (λ, T)
    assert all("lam_mean" not in h for h in plain.history[:3]) and "lam_mean" in plain.history[3]
    table = plain.server.artifacts()["persfl_clients"]
    assert list(table.columns[:5]) == ["client", "teacher_round", "teacher_val_loss", "lam", "T"]
    assert table.teacher_round.between(0, 3).all()
    # a run with one (λ, T) (a Tune trial) reproduces that grid point's validation score
    single = run(lam=0.5, T=4.0, lam_grid=(), T_grid=())
    grid = plain.server.artifacts()["persfl_grid"]
    want = grid[(grid.lam == 0.5) & (grid["T"] == 4.0)].val_acc.to_numpy()
    np.testing.assert_array_equal(single.server.artifacts()["persfl_clients"].val_acc.to_numpy(), want)


def test_final_teacher_ablation_runs():
    loop = run(teacher="final", lam_grid=(0.5,), T_grid=(2.0,))
    assert loop.history[-1]["stage"] == "distill" and loop.final["test_acc_mean"] > 0.3


def test_final_fedavg_model_is_a_teacher_candidate():
    """The final aggregate, checked at the start of stage 2, wins when its validation loss is the lowest."""
    logic = PersFLClient(PersFLParams())
    c = ScriptedClient(0, [2.0, 1.0, 0.5])
    logic.init_client(c)
    logic.track(c, np.array([0, 0.0], np.float32), 0)
    logic.track(c, np.array([1, 0.0], np.float32), 1)
    logic.step_select_teacher(c, {"round": 2}, {"global": np.array([2, 0.0], np.float32)})
    assert (c.state["teacher_round"], c.state["teacher_loss"]) == (2, 0.5)
    np.testing.assert_array_equal(c.state["teacher"], [2.0, 0.0])


def test_paper_defaults():
    """Divi et al., 2021: the per-client grid inferred from Table 5; KL soft loss; each client's best round."""
    p = PersFLParams()
    assert p.lam_grid == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert p.T_grid == (1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0)
    assert (p.lam, p.T, p.distill_epochs, p.variant, p.teacher) == (0.5, 1.0, 0, "sgd", "best")


def test_teacher_logits_cover_clients_larger_than_one_chunk():
    """The teacher's logits are computed in passes (at most 1,024 samples each): a larger client gets all of them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1100, 2, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:1050], y[:1050]), "val": (x[1050:], y[1050:]), "test": (x[1050:], y[1050:])}
    teacher = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0], np.float32)
    c = Client(0, splits, lambda: torch.nn.Linear(2, 2), teacher, TrainSettings("classification", 1, 0.1, 256), 0)
    logic = PersFLClient(PersFLParams(lam_grid=(1.0,), T_grid=(1.0,)))
    logic.init_client(c)
    c.state.update(teacher=teacher, teacher_round=1, teacher_loss=0.5)
    up = logic.step_distill(c, {"seed": 0}, {})
    assert up["lam"] == 1.0 and up["n"] == 1050


def test_default_grid_passes_the_check_and_zero_distill_epochs_means_the_runs_local_epochs(monkeypatch):
    from rayfl.algorithms import persfl

    PersFLParams().check(4)  # λ = 1 (pure imitation) is in the default grid and allowed
    PersFLParams(lam=1.0, lam_grid=()).check(4)
    seen = []

    def fake_distill(student, x, y, teacher_logits, lam, T, variant, epochs, *rest):
        seen.append(epochs)
        return 0.0

    monkeypatch.setattr(persfl, "distill", fake_distill)
    one = dict(lam=0.5, T=1.0, lam_grid=(), T_grid=())
    run_distill(PersFLParams(**one))  # tiny_client trains 2 local epochs
    run_distill(PersFLParams(**one, distill_epochs=3))
    assert seen == [2, 3]


def test_distill_returns_the_last_epochs_mean_loss_over_every_sample():
    """One epoch, one batch of all 6 samples, λ = 0 (plain cross-entropy): the returned loss is the mean
    cross-entropy of the start model over all 6 samples, computed here in numpy."""
    from rayfl.algorithms.persfl import distill

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, generator=g)  # 6 samples, 3 features: n is the sample count
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    student = torch.nn.Linear(3, 2)
    W, b = student.weight.detach().double().numpy(), student.bias.detach().double().numpy()
    logits = x.double().numpy() @ W.T + b
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = float(-logp[np.arange(6), y.numpy()].mean())
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    loss = distill(student, x, y, torch.zeros(6, 2), 0.0, 1.0, "sgd", 1, 6, opt, torch.Generator().manual_seed(0))
    assert loss == pytest.approx(expected, rel=1e-5)


def test_fedavg_round_averages_the_participants_and_sends_everyone_the_global_model():
    """Every client checks the global model as a teacher candidate; only the sampled ones train."""
    from rayfl.algorithms.base import RunInfo
    from rayfl.algorithms.persfl import PersFLServer
    from rayfl.reduce import reduce_uploads

    info = RunInfo(n_clients=3, rounds=2, participation=0.67, seed=0, n_train=[10, 10, 10])
    srv = PersFLServer(PersFLParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                       initial=np.zeros(2, np.float32))
    sent = {}

    def call(step, msgs, reduce=None):
        sent.update(msgs)
        return reduce_uploads(reduce, {c: ({"weights": np.full(2, c, np.float32), "n": 10, "train_loss": c + 1.0}
                                           if m["train"] else {}) for c, m in msgs.items()})

    m = srv.fedavg_round(0, [0, 1], call)
    assert {c: msg["train"] for c, msg in sent.items()} == {0: True, 1: True, 2: False}
    assert m["train_loss"] == pytest.approx(1.5)  # (1 + 2) / 2 over the two that trained
    np.testing.assert_allclose(srv.global_ref, [0.5, 0.5])


def test_evaluation_uses_the_global_model_then_each_clients_distilled_one():
    from rayfl.algorithms.base import RunInfo
    from rayfl.algorithms.persfl import PersFLServer

    info = RunInfo(n_clients=2, rounds=1, participation=1.0, seed=0, n_train=[1, 1])
    srv = PersFLServer(PersFLParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                       initial=np.zeros(2, np.float32))
    fedavg, distill_stage = srv.stages()
    assert srv.eval_messages(fedavg, 0, [0, 1]) == {c: {"models": {"global": srv.global_ref}} for c in (0, 1)}
    assert srv.eval_messages(distill_stage, 1, [0, 1]) == {0: {}, 1: {}}
