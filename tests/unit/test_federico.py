"""FedeRiCo (Sui et al., 2022, §3): the math on hand-made numbers, and one small federation end to end
(LocalRuntime)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.federico import FedericoClient, Mixture, Params, ema_update, eps_greedy, posterior
from rayfl.client import Client, TrainSettings


def test_ema_weights_the_new_loss_by_beta_and_leaves_unsampled_entries_stale():
    L = np.array([1.0, 2.0, 3.0])
    out = ema_update(L, [0, 2], [0.5, 1.0], beta=0.6)  # L̂ <- 0.4 L̂ + 0.6 l (beta on the NEW loss, §3.3)
    assert out == pytest.approx([0.7, 2.0, 1.8])
    assert L.tolist() == [1.0, 2.0, 3.0]  # input untouched


def test_posterior_is_softmax_of_minus_loss():
    w = posterior(np.array([0.7, 2.0, 1.8]))
    e = [math.exp(-0.7), math.exp(-2.0), math.exp(-1.8)]  # 0.496585, 0.135335, 0.165299
    assert w == pytest.approx([v / sum(e) for v in e])
    assert w == pytest.approx([0.622897, 0.169759, 0.207344], abs=1e-6)
    assert posterior(np.array([1000.0, 1001.0])) == pytest.approx([1 / (1 + math.exp(-1)), 1 / (1 + math.e)])


def test_eps_greedy_counts_under_a_fixed_seed():
    w = np.array([0.50, 0.30, 0.10, 0.05, 0.03, 0.02])  # client 0 itself has the largest weight
    rng = np.random.default_rng(0)
    draws = [eps_greedy(w, 0, 2, 0.25, rng) for _ in range(20000)]
    assert all(len(set(d)) == 2 and 0 not in d for d in draws)  # M distinct, never itself
    counts = np.bincount(np.concatenate(draws), minlength=6) / len(draws)
    # greedy (prob 0.75) takes the top-2 others {1, 2}; uniform (0.25) takes each of the 5 others w.p. 2/5
    assert counts == pytest.approx([0.0, 0.85, 0.85, 0.10, 0.10, 0.10], abs=0.01)
    assert np.mean([d == [1, 2] for d in draws]) == pytest.approx(0.75 + 0.25 / 10, abs=0.01)
    again = np.random.default_rng(0)
    assert [eps_greedy(w, 0, 2, 0.25, again) for _ in range(20000)] == draws  # seeded: reproducible
    assert eps_greedy(w, 3, 3, 0.0, rng) == [0, 1, 2]  # ε = 0: pure top-M, self excluded
    ties = np.bincount(np.concatenate([eps_greedy(np.full(5, 0.2), 4, 1, 0.0, rng) for _ in range(4000)]))
    assert ties[:4] / 4000 == pytest.approx([0.25] * 4, abs=0.03)  # tied top-M broken at random
    assert eps_greedy(w, 0, 0, 0.3, rng) == []


def test_params_check():
    Params().check(8)
    Params(epsilon=0.0, M=0, beta=0.0).check(8)  # boundaries allowed: greedy, local only, no EMA update
    Params(epsilon=1.0, M=7).check(8)
    for bad, msg in (({"M": 8}, r"M=8: must be in \[0, clients-1\] = \[0, 7\]"), ({"epsilon": 1.5}, "epsilon=1.5"), ({"beta": 1.0}, "beta=1.0"),
                     ({"init_losses": "zero"}, "init_losses")):
        with pytest.raises(ValueError, match=msg):
            Params(**bad).check(8)


def _client(cid, x, y, lr=1.0):
    """A 1-D linear regression client h(x) = a x + b, full-batch, plain SGD with lr 1 (so Δφ = -G)."""
    t = lambda v: torch.tensor(v, dtype=torch.float32).view(-1, 1)  # noqa: E731
    empty = (torch.zeros(0, 1), torch.zeros(0, 1))
    make = lambda: nn.Sequential(nn.Flatten(), nn.Linear(1, 1))  # noqa: E731
    settings = TrainSettings("regression", 1, lr, 100, "sgd")
    return Client(cid, {"train": (t(x), t(y)), "val": empty, "test": empty}, make, None, settings, seed=0)


def test_owner_applies_the_column_weighted_gradient_sum():
    """Eq. 8: φ_0 moves by Σ_k w_k0 (n_k/n̄) ∇ mean-loss(φ_0; D_k) — column 0 of W, not row 0."""
    data = {0: ([1.0, 2.0], [1.0, 2.0]), 1: ([1.0], [3.0]), 2: ([2.0], [0.0])}  # n = 2, 1, 1; n̄ = 4/3
    W = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])
    logic = FedericoClient(Params(M=2, epsilon=0.0, beta=0.0))  # β = 0: the hand-made L̂ (so W) stays
    clients = {}
    for i, (x, y) in data.items():
        c = _client(i, x, y)
        logic.init_client(c)
        c.load(np.array([1.0, 0.0], dtype=np.float32))  # every φ = (a=1, b=0)
        c.state.update(L=-np.log(W[i]), w=W[i], K=3, scale=c.n() / (4 / 3))  # softmax(-L) == W[i]
        clients[i] = c
    ups = {i: logic.step_estep(c, {}, {"peers": {j: clients[j].vector() for j in range(3) if j != i}})
           for i, c in clients.items()}
    # gradients of the mean squared error at (1, 0): D_0 -> (0, 0), D_1 -> (-4, -4), D_2 -> (8, 4)
    assert ups[1]["grads"][0] == pytest.approx(0.6 * 0.75 * np.array([-4.0, -4.0]))  # w_10 (n_1/n̄) ∇
    assert ups[2]["grads"][0] == pytest.approx(0.1 * 0.75 * np.array([8.0, 4.0]))
    logic.step_mstep(clients[0], {}, {"grads": [ups[1]["grads"][0], ups[2]["grads"][0]]})
    G = 0.5 * 1.5 * np.zeros(2) + 0.6 * 0.75 * np.array([-4, -4]) + 0.1 * 0.75 * np.array([8, 4])  # (-1.2, -1.5)
    assert clients[0].vector() == pytest.approx(np.array([1.0, 0.0]) - G)  # (2.2, 1.5)
    row = 0.3 * 0.75 * np.array([-4, -4]) + 0.2 * 0.75 * np.array([8, 4])  # what w_0k would have given
    assert not np.allclose(clients[0].vector(), np.array([1.0, 0.0]) - row)
    assert all(ups[i]["next"] == [j for j in range(3) if j != i] for i in range(3))  # M = 2 of 2 others


def test_prediction_is_a_mixture_of_probabilities():
    class Const(nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.tensor(logits)

        def forward(self, x):
            return self.logits.expand(x.shape[0], -1)

    a, b = Const([0.0, math.log(3.0)]), Const([math.log(3.0), 0.0])  # p = (.25, .75) and (.75, .25)
    out = Mixture([a, b], [0.8, 0.2], "classification")(torch.zeros(2, 1))
    assert out.exp()[0].tolist() == pytest.approx([0.8 * 0.25 + 0.2 * 0.75, 0.8 * 0.75 + 0.2 * 0.25])
    reg = Mixture([Const([2.0]), Const([4.0])], [0.25, 0.75], "regression")(torch.zeros(1, 1))
    assert reg.item() == pytest.approx(3.5)


def test_the_mixture_runs_where_its_members_are():
    """On a GPU the members and the inputs are on the client's device, and so must the weights be; the meta
    device (shapes only) stands in for a GPU this CPU-only suite does not have."""
    members = [nn.Linear(3, 4).to("meta"), nn.Linear(3, 4).to("meta")]
    for task in ("classification", "regression"):
        out = Mixture(members, [0.3, 0.7], task)(torch.zeros(5, 3, device="meta"))
        assert out.device.type == "meta" and out.shape == (5, 4)


def test_weights_concentrate_within_label_groups():
    """6 clients, 2 disjoint label groups of digits: clients of one group share models, clients of different
    groups rarely do. Measured by co-usage (W Wᵀ)_ik = Σ_j w_ij w_kj, because under Eq. 8 a model may come to
    serve another group than its owner's (see FedericoServer.weight_metrics). Digits, not `synthetic`: on the
    synthetic mixture every model reaches ~100% on both groups, so the mean-loss posterior is legitimately flat."""
    from rayfl.config import make_config
    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.runtime import LocalRuntime

    cfg = make_config(None, {"algo": "federico", "dataset": "digits", "partition": "label-groups", "groups": 2,
                             "clients": 6, "rounds": 40, "optimizer": "adam", "lr": 0.01, "eval_every": 40,
                             "val_frac": 0.0, "seed": 0, "group_assign": "blocks",
                             "params": {"M": 2, "local_steps": 1}})
    prepared = prepare(cfg)
    loop = Loop(prepared, LocalRuntime(prepared)).run()
    W, g = loop.server.W, np.asarray(prepared.info.groups)
    assert W.shape == (6, 6) and W.sum(1) == pytest.approx(np.ones(6))
    assert loop.server.round_artifacts(39)["W"].shape == (6, 6) and "W" in loop.server.artifacts()
    C = W @ W.T
    same, cross = C[(g[:, None] == g) & ~np.eye(6, dtype=bool)].mean(), C[g[:, None] != g].mean()
    assert cross < 0.5 * same, (np.round(W, 2), same, cross)
    first, last = loop.history[0]["w_same_group_mean"], loop.history[-1]["w_same_group_mean"]
    assert first < 0.55 < last, (first, last)  # ~1/2 at the start (uniform), then mass moves into the group
    assert loop.final["test_acc_weighted_mean"] > 0.9


def test_gradients_use_the_new_posterior_and_scale_the_own_term():
    """§3.2: the E-step first updates L̂ with the batch losses (β > 0), then weights every gradient, the
    owner's own term included, by the NEW w_ij. Every client has a non-zero gradient on its own data."""
    data = {0: ([1.0, 2.0], [2.0, 2.0]), 1: ([1.0], [3.0]), 2: ([2.0], [0.0])}  # n = 2, 1, 1; n̄ = 4/3
    W = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])
    beta, phi = 0.5, np.array([1.0, 0.0])  # every φ = (a=1, b=0): h(x) = x
    logic = FedericoClient(Params(M=2, epsilon=0.0, beta=beta))
    clients = {}
    for i, (x, y) in data.items():
        c = _client(i, x, y)
        logic.init_client(c)
        c.load(phi.astype(np.float32))
        c.state.update(L=-np.log(W[i]), w=W[i], K=3, scale=c.n() / (4 / 3))
        clients[i] = c
    ups = {i: logic.step_estep(c, {}, {"peers": {j: clients[j].vector() for j in range(3) if j != i}})
           for i, c in clients.items()}

    def mse_and_grad(x, y):  # of the mean squared error of h(x) = a x + b at (1, 0), by hand
        x, y = np.array(x), np.array(y)
        r = x - y
        return float(np.mean(r ** 2)), np.array([np.mean(2 * r * x), np.mean(2 * r)])

    new_w = {}
    for i, (x, y) in data.items():
        loss, _ = mse_and_grad(x, y)  # identical models: the same loss for every owner j
        L = (1 - beta) * -np.log(W[i]) + beta * loss
        new_w[i] = np.exp(-L) / np.exp(-L).sum()
        assert ups[i]["w"] == pytest.approx(new_w[i])
    scale = {0: 1.5, 1: 0.75, 2: 0.75}
    G = sum(new_w[i][0] * scale[i] * mse_and_grad(*data[i])[1] for i in range(3))  # column 0, own term included
    assert ups[1]["grads"][0] == pytest.approx(new_w[1][0] * 0.75 * mse_and_grad(*data[1])[1])
    logic.step_mstep(clients[0], {}, {"grads": [ups[1]["grads"][0], ups[2]["grads"][0]]})
    assert clients[0].vector() == pytest.approx(phi - G)


def test_a_round_makes_local_steps_iterations_and_defaults_to_the_baselines_steps():
    """local_steps E/M iterations per round; 0 = local_epochs x ceil(n_i / batch) averaged over clients."""
    from rayfl.algorithms.base import RunInfo, Stage
    from rayfl.algorithms.federico import FedericoServer

    def server(steps):
        info = RunInfo(n_clients=2, rounds=1, participation=1.0, seed=0, n_train=[40, 80])
        return FedericoServer(Params(M=1, local_steps=steps), info, put=lambda v: v, get=list,
                              rng=np.random.default_rng(0), initial=np.zeros(2, np.float32))

    calls, sent = [], {}

    def call(step, msgs):
        calls.append(step)
        sent[step] = msgs
        if step == "share":
            return {i: {"model": np.zeros(2, np.float32)} for i in msgs}
        if step == "init":
            return {i: {"w": np.full(2, 0.5), "next": [1 - i], "steps": [2, 4][i]} for i in msgs}
        if step == "estep":
            return {i: {"w": np.full(2, 0.5), "next": [1 - i], "grads": {}, "loss": 1.0, "n": 40} for i in msgs}
        return {i: {"model": np.zeros(2, np.float32)} for i in msgs}

    for steps, expected in ((3, 3), (0, 3)):  # 0: mean of (2, 4) steps
        calls.clear()
        srv = server(steps)
        assert srv.setup(call)["local_steps"] == expected
        srv.run_round(Stage("train", 1), 0, [0, 1], call)
        assert calls[2:] == ["estep", "mstep"] * expected
        assert {i: set(m["models"]["peers"]) for i, m in sent["init"].items()} == {0: {1}, 1: {0}}  # all others
    srv = FedericoServer(Params(M=1, init_losses="own"), server(1).info, put=lambda v: v, get=list,
                         rng=np.random.default_rng(0), initial=np.zeros(2, np.float32))
    srv.setup(call)
    assert all(m["models"]["peers"] == {} for m in sent["init"].values())  # "own": no communication
    c = _client(0, [1.0] * 70, [0.0] * 70)  # 70 samples, batch 100, 1 epoch: 1 step
    logic = FedericoClient(Params(M=0))
    logic.init_client(c)
    assert logic.step_init(c, {"K": 1, "n_mean": 70.0}, {})["steps"] == 1
    with pytest.raises(ValueError, match="local_steps=-1"):
        Params(local_steps=-1).check(4)


def test_paper_defaults():
    """Sui et al., 2022, §4.1: ε = 0.3, M = 3, β = 0.6 on the new loss; the mean loss and a baseline's steps
    per round."""
    p = Params()
    assert (p.epsilon, p.M, p.beta, p.init_losses, p.loss_sum, p.local_steps) == (0.3, 3, 0.6, "all", False, 0)


def test_cousage_band_on_ordered_intervals():
    """Co-usage (W Wᵀ)_ik of adjacent sine intervals against far ones, from a hand-made W."""
    from rayfl.algorithms.base import RunInfo
    from rayfl.algorithms.federico import FedericoServer

    info = RunInfo(n_clients=3, rounds=1, participation=1.0, seed=0, n_train=[5] * 3, task="regression",
                   groups=[0, 1, 2])
    srv = FedericoServer(Params(M=1), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                         initial=np.zeros(2, np.float32))
    srv.W = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    C = srv.W @ srv.W.T  # [[.5, .25, 0], [.25, .5, .5], [0, .5, 1]]
    m = srv.weight_metrics()
    assert m["cousage_neighbour_mean"] == pytest.approx((0.25 + 0.5) / 2)  # pairs (0,1), (1,2), both ways
    assert m["cousage_far_mean"] == pytest.approx(0.0) and C[0, 2] == 0.0
    assert m["w_self_mean"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_a_prediction_mixes_the_collaborators_of_weight_at_least_1e_4():
    """What client i's evaluation is sent, and the mean mixture size logged: own model plus every j != i with
    w_ij >= 1e-4, counted by hand from a W with weights on both sides of the line."""
    from rayfl.algorithms.base import RunInfo
    from rayfl.algorithms.federico import FedericoServer

    info = RunInfo(n_clients=3, rounds=1, participation=1.0, seed=0, n_train=[5] * 3, task="classification")
    srv = FedericoServer(Params(M=1), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                         initial=np.zeros(2, np.float32))
    srv.models = {0: "phi0", 1: "phi1", 2: "phi2"}
    srv.W = np.array([[0.6, 0.4, 0.0], [0.00009, 0.6, 0.39991], [0.0001, 0.0, 0.9999]])
    peers = {i: m["models"]["peers"] for i, m in srv.eval_messages(None, 0, [0, 1, 2]).items()}
    assert peers == {0: {1: "phi1"}, 1: {2: "phi2"}, 2: {0: "phi0"}}
    assert srv.weight_metrics()["mixture_members_mean"] == pytest.approx((2 + 2 + 2) / 3)
    srv.W[2, 0] = 0.0
    assert srv.weight_metrics()["mixture_members_mean"] == pytest.approx((2 + 2 + 1) / 3)


def test_initial_losses_use_the_whole_train_split_and_loss_sum_scales_by_n():
    """L̂ at t = 0 is every model's mean loss on the FULL train split, not one minibatch (here n = 4 > batch
    2); with ``loss_sum`` (Eq. 3 literally) every loss, at t = 0 and in the E-step, is n_i x the mean."""
    t = lambda v: torch.tensor(v, dtype=torch.float32).view(-1, 1)  # noqa: E731
    x, y = [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 5.0]
    empty = (torch.zeros(0, 1), torch.zeros(0, 1))
    make = lambda: nn.Sequential(nn.Flatten(), nn.Linear(1, 1))  # noqa: E731
    phi = {0: np.array([1.0, 0.0], np.float32), 1: np.array([0.0, 2.0], np.float32)}  # h(x) = x and h(x) = 2
    # by hand: squared residuals of h = x are (1, 1, 4, 4) -> MSE 2.5; of h = 2: (1, 4, 4, 9) -> 4.5 (no
    # 2-point batch of the latter has mean 4.5, so a minibatch in place of the full split shows)
    full = np.array([2.5, 4.5])
    for loss_sum, scale in ((False, 1.0), (True, 4.0)):
        for batch in (2, 100):  # 2: init must still use all 4 points; 100: the E-step batch is the full split
            c = Client(0, {"train": (t(x), t(y)), "val": empty, "test": empty}, make, None,
                       TrainSettings("regression", 1, 0.1, batch, "sgd"), seed=0)
            logic = FedericoClient(Params(M=1, epsilon=0.0, beta=1.0, loss_sum=loss_sum))
            logic.init_client(c)
            c.load(phi[0])
            out = logic.step_init(c, {"K": 2, "n_mean": 2.0}, {"peers": {1: phi[1]}})
            assert c.state["scale"] == 2.0  # n_i / n̄ = 4 / 2 (Eq. 8's sum over n_i points, divided by n̄)
            assert c.state["L"] == pytest.approx(scale * full)
            assert out["w"] == pytest.approx(posterior(scale * full))
            if batch == 2:  # the E-step takes one minibatch of 2 of the 4 points: peer loss in {2.5, 4, 5, 6.5}
                logic.step_estep(c, {}, {"peers": {1: phi[1]}})
                assert min(abs(c.state["L"][1] / scale - v) for v in (2.5, 4.0, 5.0, 6.5)) < 1e-5
            if batch == 100:  # E-step with β = 1: L̂ is the new batch losses, x n_i under loss_sum
                c.state["L"] = np.zeros(2)
                up = logic.step_estep(c, {}, {"peers": {1: phi[1]}})
                assert c.state["L"] == pytest.approx(scale * full)
                assert up["w"] == pytest.approx(posterior(scale * full))


def test_evaluation_sends_the_collaborators_above_the_weight_floor_never_the_client_itself():
    from rayfl.algorithms.base import RunInfo
    from rayfl.algorithms.federico import PRED_MIN_WEIGHT, FedericoServer

    info = RunInfo(n_clients=3, rounds=1, participation=1.0, seed=0, n_train=[5] * 3)
    srv = FedericoServer(Params(M=1), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                         initial=np.zeros(2, np.float32))
    srv.models = {0: "m0", 1: "m1", 2: "m2"}
    srv.W = np.array([[0.6, 0.4, 0.0], [PRED_MIN_WEIGHT / 2, 0.5, 0.5], [0.2, 0.3, 0.5]])
    msgs = srv.eval_messages(None, 0, [0, 1, 2])
    assert {i: m["models"]["peers"] for i, m in msgs.items()} == {0: {1: "m1"}, 1: {2: "m2"},
                                                                   2: {0: "m0", 1: "m1"}}
