"""FedEM (Marfoq et al., NeurIPS 2021): the E-step and π's M-step on hand numbers (log-sum-exp stable), the
q-weighted LocalSolver loss and its gradient against a numpy computation, a client round in Algorithm 1's order,
the server's n_t-weighted component average, the mixture prediction (accuracy, NLL) on hand-made component
outputs, the independent initialisations, M = 1 being FedAvg exactly, and clients of different latent groups
ending with different π."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import tiny
from rayfl import training
from rayfl.algorithms import fedem
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.fedem import (FedEMClient, FedEMServer, Params, e_step, local_solver, mixture_log_prob,
                                    mixture_metrics, per_sample_losses, update_pi, weighted_loss)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime

LN2, LN4 = np.log(2.0), np.log(4.0)


# ------------------------------------------------------------------------------- numpy references (not fedem)

def np_linear(vec, x):
    """Logits of torch.nn.Linear(3, 2) flattened as (weight 2x3 row-major, bias 2)."""
    w, b = np.asarray(vec, np.float64)[:6].reshape(2, 3), np.asarray(vec, np.float64)[6:]
    return np.asarray(x, np.float64) @ w.T + b


def np_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def np_ce(vec, x, y):
    """Per-sample cross-entropy of the linear model."""
    p = np_softmax(np_linear(vec, x))
    return -np.log(p[np.arange(len(y)), np.asarray(y)])


def np_weighted_grad(vec, x, y, q):
    """d/dθ of Σ_i q_i ℓ_i / B for the linear model: Σ_i q_i (p_i - e_yi) x_iᵀ / B (weight) and
    Σ_i q_i (p_i - e_yi) / B (bias)."""
    x, q = np.asarray(x, np.float64), np.asarray(q, np.float64)
    p = np_softmax(np_linear(vec, x))
    d = p.copy()
    d[np.arange(len(y)), np.asarray(y)] -= 1.0
    d *= q[:, None] / len(y)
    return np.concatenate([(d.T @ x).reshape(-1), d.sum(axis=0)])


def tiny_client(n=4, seed=0, epochs=1, batch=4, lr=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, 3, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:n], y[:n]), "val": (x[n:2 * n], y[n:2 * n]), "test": (x[2 * n:], y[2 * n:])}
    settings = TrainSettings("classification", epochs, lr, batch)
    return Client(0, splits, lambda: torch.nn.Linear(3, 2), np.zeros(8, np.float32), settings, seed)


# ------------------------------------------------------------------------------------------- E-step, π

def test_e_step_on_hand_numbers():
    pi = np.array([0.5, 0.25, 0.25])
    # sample 1: exp(-ℓ) = (1, 1/2, 1/4), π·p = (1/2, 1/8, 1/16), sum 11/16 -> q = (8, 2, 1) / 11
    # sample 2: exp(-ℓ) = (1/4, 1, 1),   π·p = (1/8, 1/4, 1/4),  sum 5/8   -> q = (0.2, 0.4, 0.4)
    losses = np.array([[0.0, LN2, LN4], [LN4, 0.0, 0.0]])
    q = e_step(pi, losses)
    np.testing.assert_allclose(q, [[8 / 11, 2 / 11, 1 / 11], [0.2, 0.4, 0.4]], rtol=1e-12)
    # the prior matters: the same losses under a uniform π give sample 1 (4, 2, 1) / 7
    np.testing.assert_allclose(e_step(np.full(3, 1 / 3), losses)[0], [4 / 7, 2 / 7, 1 / 7], rtol=1e-12)


def test_e_step_is_stable_for_large_losses():
    pi = np.array([0.5, 0.25, 0.25])
    # losses in the thousands (exp(-1000) is 0 in float64): only differences matter, per sample; a second
    # sample of small losses in the same call is normalised on its own
    losses = np.array([[1000.0, 1000.0 + LN2, 1000.0 + LN4], [LN4, 0.0, 0.0], [0.0, 800.0, 900.0]])
    q = e_step(pi, losses)
    assert np.all(np.isfinite(q))
    np.testing.assert_allclose(q[0], [8 / 11, 2 / 11, 1 / 11], rtol=1e-12)
    np.testing.assert_allclose(q[1], [0.2, 0.4, 0.4], rtol=1e-12)
    np.testing.assert_allclose(q[2], [1.0, 0.0, 0.0], atol=1e-300)
    # a component with π = 0 gets no responsibility, whatever its losses
    np.testing.assert_array_equal(e_step(np.array([0.0, 1.0]), np.array([[0.0, 50.0]])), [[0.0, 1.0]])


def test_pi_is_the_mean_responsibility():
    q = np.array([[8 / 11, 2 / 11, 1 / 11], [0.2, 0.4, 0.4]])
    # π_m = (1/n) Σ_i q_im
    np.testing.assert_allclose(update_pi(q), [(8 / 11 + 0.2) / 2, (2 / 11 + 0.4) / 2, (1 / 11 + 0.4) / 2])
    assert update_pi(q).sum() == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------- M-step for Θ

def test_weighted_loss_and_gradient_against_numpy():
    x = np.array([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0], [2.0, 0.5, -1.0], [-1.0, -1.0, 3.0]], np.float32)
    y = np.array([0, 1, 1, 0])
    q = np.array([0.2, 0.7, 1.0, 0.1])
    vec = np.array([0.3, -0.2, 0.1, -0.4, 0.5, 0.2, 0.05, -0.1], np.float32)
    model = torch.nn.Linear(3, 2)
    training.load_vector(model, vec)
    loss = weighted_loss(model(torch.tensor(x)), torch.tensor(y), torch.tensor(q, dtype=torch.float32))
    assert float(loss.detach()) == pytest.approx(float((q * np_ce(vec, x, y)).sum() / 4), rel=1e-6)  # Σ q ℓ / B
    loss.backward()
    grad = np.concatenate([model.weight.grad.numpy().reshape(-1), model.bias.grad.numpy()])
    np.testing.assert_allclose(grad, np_weighted_grad(vec, x, y, q), rtol=1e-5, atol=1e-7)


def test_local_solver_runs_the_epochs_on_q_weighted_minibatches():
    """Two epochs, batches of 2 of 4 samples: replayed in numpy with the same batch order."""
    client = tiny_client(n=4, epochs=2, batch=2, lr=0.5)
    x, y = client.splits["train"]
    q = np.array([0.9, 0.1, 0.6, 0.3])
    vec = np.array([0.3, -0.2, 0.1, -0.4, 0.5, 0.2, 0.05, -0.1], np.float32)
    replay = torch.Generator().set_state(client.gen.get_state())
    expect, xs, ys = vec.astype(np.float64), x.numpy(), y.numpy()
    last = 0.0
    for _ in range(2):
        order = torch.randperm(4, generator=replay).numpy()
        last = 0.0
        for b in (order[:2], order[2:]):
            last += (q[b] * np_ce(expect, xs[b], ys[b])).sum()  # batch loss · |B|
            expect = expect - 0.5 * np_weighted_grad(expect, xs[b], ys[b], q[b])
    model = client.scratch(vec)
    got = local_solver(model, x, y, torch.tensor(q, dtype=torch.float32), client.settings, client.gen)
    np.testing.assert_allclose(client.vector(model), expect, rtol=1e-5, atol=1e-6)
    assert got == pytest.approx(last / 4, rel=1e-5)  # the last epoch's mean weighted loss


# ------------------------------------------------------------------------------------------- a client round

def test_client_round_follows_algorithm_1():
    """E-step at the RECEIVED components with the PREVIOUS π, π = mean q, then component m trained on column m
    of q (full batch: one step θ_m - lr ∇ Σ_i q_im ℓ_i / n), uploaded concatenated with n and the new π."""
    client, logic = tiny_client(n=4, epochs=1, batch=4, lr=0.5), FedEMClient(Params(M=2))
    logic.init_client(client)
    np.testing.assert_array_equal(client.state["pi"], [0.5, 0.5])  # uniform at the start
    client.state["pi"] = np.array([0.3, 0.7])  # π^{k-1} from an earlier round
    good = np.array([-2, 0, 0, 2, 0, 0, 0, 0], np.float32)  # logit_1 - logit_0 = 4·x0: right
    bad = np.array([1, 0, 0, -1, 0, 0, 0.3, 0], np.float32)
    x, y = (t.numpy() for t in client.splits["train"])
    losses = np.stack([np_ce(good, x, y), np_ce(bad, x, y)], axis=1)
    prior = np.array([0.3, 0.7]) * np.exp(-losses)
    q = prior / prior.sum(axis=1, keepdims=True)
    up = logic.step_train(client, {}, {"components": [good, bad]})
    np.testing.assert_allclose(client.state["pi"], q.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(up["pi"], q.mean(axis=0), rtol=1e-6)
    assert up["n"] == 4 and up["weights"].shape == (16,)
    for m, vec in enumerate([good, bad]):
        expect = vec - 0.5 * np_weighted_grad(vec, x, y, q[:, m])
        np.testing.assert_allclose(up["weights"][8 * m:8 * (m + 1)], expect, rtol=1e-5, atol=1e-6)
    losses_sum = sum((q[:, m] * np_ce(v, x, y)).sum() / 4 for m, v in enumerate([good, bad]))
    assert up["train_loss"] == pytest.approx(losses_sum, rel=1e-5)  # Σ_m of the components' weighted losses


def test_a_client_without_training_data_keeps_pi_and_returns_the_components_with_weight_zero():
    client, logic = tiny_client(n=4), FedEMClient(Params(M=2))
    client.splits["train"] = (client.splits["train"][0][:0], client.splits["train"][1][:0])
    client.state["pi"] = np.array([0.25, 0.75])
    a, b = np.arange(8, dtype=np.float32), -np.arange(8, dtype=np.float32)
    up = logic.step_train(client, {}, {"components": [a, b]})
    assert up["n"] == 0 and np.isnan(up["train_loss"])
    np.testing.assert_array_equal(up["weights"], np.concatenate([a, b]))
    np.testing.assert_array_equal(client.state["pi"], [0.25, 0.75])


# ------------------------------------------------------------------------------------------- prediction

def test_mixture_log_prob_on_hand_outputs():
    p1, p2 = np.array([[0.7, 0.2, 0.1], [0.6, 0.39, 0.01]]), np.array([[0.1, 0.3, 0.6], [0.01, 0.39, 0.6]])
    logits = [torch.tensor(np.log(p1)), torch.tensor(np.log(p2))]  # softmax(log p) = p
    got = mixture_log_prob(np.array([0.25, 0.75]), logits).exp().numpy()
    # Σ_m π_m p_m: (0.25·0.7 + 0.75·0.1, ...) = (0.25, 0.275, 0.475); second row (0.1575, 0.39, 0.4525)
    np.testing.assert_allclose(got, [[0.25, 0.275, 0.475], [0.1575, 0.39, 0.4525]], rtol=1e-10)
    one = mixture_log_prob(np.array([1.0, 0.0]), logits).exp().numpy()  # π = 0: log 0 = -inf, left out
    np.testing.assert_allclose(one, p1, rtol=1e-10)


def constant_model(probs) -> np.ndarray:
    """Linear(3, 2) with zero weights and bias log p: softmax(output) = p whatever x."""
    return np.array([0, 0, 0, 0, 0, 0, *np.log(probs)], np.float32)


def test_evaluation_is_the_pi_mixture_of_probabilities_and_leaves_the_client_as_it_was():
    client, logic = tiny_client(n=4), FedEMClient(Params(M=2))
    client.state["pi"] = np.array([0.3, 0.7])
    comps = [constant_model([0.9, 0.1]), constant_model([0.2, 0.8])]
    gen, rng, weights = client.gen.get_state(), client.rng.bit_generator.state, client.weights()
    rec = logic.step_evaluate(client, {}, {"components": comps})
    # mixture (0.3·0.9 + 0.7·0.2, 0.3·0.1 + 0.7·0.8) = (0.41, 0.59): predicts class 1 for every sample
    for split in ("val", "test"):
        y = client.splits[split][1].numpy()
        assert rec[f"n_{split}"] == 4
        assert rec[f"{split}_acc"] == pytest.approx(np.mean(y == 1))
        assert rec[f"{split}_loss"] == pytest.approx(-np.mean(np.where(y == 1, np.log(0.59), np.log(0.41))),
                                                     rel=1e-5)
    client.state["pi"] = np.array([0.7, 0.3])  # (0.69, 0.31): class 0 now
    rec = logic.step_evaluate(client, {}, {"components": comps})
    y = client.splits["test"][1].numpy()
    assert rec["test_acc"] == pytest.approx(np.mean(y == 0))
    assert rec["test_loss"] == pytest.approx(-np.mean(np.where(y == 1, np.log(0.31), np.log(0.69))), rel=1e-5)
    np.testing.assert_array_equal(client.state["pi"], [0.7, 0.3])
    assert torch.equal(client.gen.get_state(), gen) and client.rng.bit_generator.state == rng
    assert client.weights() is None and weights is None  # no personal weights made
    client.splits["val"] = (client.splits["val"][0][:0], client.splits["val"][1][:0])
    rec = logic.step_evaluate(client, {}, {"components": comps})
    assert rec["n_val"] == 0 and np.isnan(rec["val_loss"]) and np.isnan(rec["val_acc"])


def test_e_step_losses_and_mixture_read_the_models_in_eval_mode_and_in_passes(monkeypatch):
    """Per-sample losses and the mixture's metrics with dropout in the models (eval mode: no dropout) and more
    samples than one pass holds (3 here): the numpy values of the plain linear models."""
    monkeypatch.setattr(fedem, "EVAL_BATCH", 3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 3, generator=g), torch.tensor([0, 1, 1, 0, 1, 0, 0])
    a = np.array([0.3, -0.2, 0.1, -0.4, 0.5, 0.2, 0.05, -0.1], np.float32)
    b = np.array([-1.0, 0.5, 0.0, 1.0, -0.5, 0.3, 0.2, 0.0], np.float32)
    nets = []
    for vec in (a, b):
        net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.9))
        training.load_vector(net, vec)
        net.train()  # left in training mode by an earlier step
        nets.append(net)
    xs, ys = x.numpy(), y.numpy()
    np.testing.assert_allclose(per_sample_losses(nets, x, y), np.stack([np_ce(a, xs, ys), np_ce(b, xs, ys)], 1),
                               rtol=1e-5)
    for net in nets:
        net.train()
    mix = 0.4 * np_softmax(np_linear(a, xs)) + 0.6 * np_softmax(np_linear(b, xs))
    loss, acc = mixture_metrics(nets, np.array([0.4, 0.6]), x, y)
    assert loss == pytest.approx(-np.mean(np.log(mix[np.arange(7), ys])), rel=1e-5)
    assert acc == pytest.approx(np.mean(mix.argmax(1) == ys))


# ------------------------------------------------------------------------------------------- driver side

def make_server(k=3, M=2, n=(10, 30, 60), n_params=2):
    info = RunInfo(n_clients=k, rounds=2, participation=1.0, seed=7, n_train=list(n), n_params=n_params)
    return FedEMServer(Params(M=M), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                       initial=np.zeros(n_params, np.float32))


def test_server_averages_each_component_by_training_set_size():
    srv = make_server(k=4)
    np.testing.assert_array_equal(srv.artifacts()["pi"], np.full((4, 2), 0.5))  # uniform until uploaded
    srv.components = [np.zeros(2, np.float32), np.ones(2, np.float32)]
    comps = {0: ([1.0, 0.0], [2.0, 2.0]), 1: ([0.0, 1.0], [4.0, 0.0]), 2: ([3.0, 3.0], [0.0, 6.0])}
    sizes = {0: 10, 1: 30, 2: 60}
    pis = {0: [0.9, 0.1], 1: [0.5, 0.5], 2: [0.2, 0.8]}
    sent = {}

    def call(step, msgs, reduce=None):  # the reduction the engine would run inside the client actors
        sent.update(step=step, msgs=msgs)
        return reduce_uploads(reduce, {c: {"weights": np.array(comps[c][0] + comps[c][1], np.float32),
                                           "n": sizes[c], "train_loss": float(c), "pi": np.array(pis[c])}
                                       for c in msgs})

    metrics = srv.run_round(Stage("train", 2), 0, [0, 1, 2], call)
    assert sent["step"] == "train" and sorted(sent["msgs"]) == [0, 1, 2]
    sent_comps = sent["msgs"][0]["models"]["components"]
    assert len(sent_comps) == 2 and sent_comps[1][0] == 1.0  # the M components before the round
    # θ_1 = (10·(1,0) + 30·(0,1) + 60·(3,3)) / 100 = (1.9, 2.1); θ_2 = (10·(2,2) + 30·(4,0) + 60·(0,6)) / 100
    # = (1.4, 3.8). Weighting by Σ_i q_im = n_t π_tm instead would give θ_1 = (9+0+36, 0+15+36)/60 = (0.75, 0.85)
    np.testing.assert_allclose(srv.components[0], [1.9, 2.1], rtol=1e-6)
    np.testing.assert_allclose(srv.components[1], [1.4, 3.8], rtol=1e-6)
    assert metrics["train_loss"] == pytest.approx((0 * 10 + 1 * 30 + 2 * 60) / 100)
    assert metrics["pi_max_mean"] == pytest.approx((0.9 + 0.5 + 0.8) / 3)
    pi = srv.artifacts()["pi"]
    np.testing.assert_array_equal(pi[:3], [pis[0], pis[1], pis[2]])
    np.testing.assert_array_equal(pi[3], [0.5, 0.5])  # never took part: still uniform
    np.testing.assert_array_equal(srv.round_artifacts(0)["pi"], pi)
    ev = srv.eval_messages(Stage("train", 2), 0, [0, 3])
    assert list(ev) == [0, 3] and all(len(m["models"]["components"]) == 2 for m in ev.values())
    np.testing.assert_array_equal(ev[3]["models"]["components"][0], srv.components[0])


def test_server_state_round_trips_before_and_after_setup():
    srv = make_server(M=3)
    state = srv.state_dict()
    assert state["components"].shape == (0, 2)  # before setup: no components yet
    other = make_server(M=3)
    other.load_state_dict(state)
    assert other.components == []
    srv.components = [np.full(2, m, np.float32) for m in range(3)]
    srv.pi[1] = [0.2, 0.3, 0.5]
    other.load_state_dict(srv.state_dict())
    np.testing.assert_array_equal(np.stack(other.components), [[0, 0], [1, 1], [2, 2]])
    np.testing.assert_array_equal(other.pi, srv.pi)


def test_components_are_initialised_independently_from_seed_plus_m():
    p = prepare(tiny(algo="fedem", clients=2, rounds=1, params={"M": 3}))
    rt = LocalRuntime(p)
    srv = FedEMServer(Params(M=3), p.info, rt.put, rt.get, np.random.default_rng(0), p.initial)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    srv.setup(rt.call)
    assert torch.equal(torch.rand(3), before)  # the global torch RNG is left as it was
    assert len(srv.components) == 3
    np.testing.assert_array_equal(srv.components[0], p.initial)  # θ_1: the run's common initial model
    for m in (1, 2):  # θ_m: built after torch.manual_seed(seed + m), as the authors' code does
        torch.manual_seed(p.cfg.seed + m)
        np.testing.assert_array_equal(srv.components[m], training.to_vector(p.model_spec.build()))
    assert not np.array_equal(srv.components[1], srv.components[2])
    single = FedEMServer(Params(M=1), p.info, rt.put, rt.get, np.random.default_rng(0), p.initial)

    def no_call(*args, **kwargs):
        raise AssertionError("M = 1 needs no client call")

    single.setup(no_call)
    assert len(single.components) == 1 and single.components[0] is single.initial


def test_params_check():
    Params().check(3)
    Params(M=1).check(3)
    Params(M=7).check(3)  # components are not clients: more than clients is allowed
    assert Params().M == 4  # FedeRiCo's Table 1 setting (the FedEM paper's own default is 3)
    for bad in (0, -1, 2.5, True, float("nan")):
        with pytest.raises(ValueError, match="M="):
            Params(M=bad).check(3)
    Params().check_config(SimpleNamespace(dataset="digits"))
    with pytest.raises(ValueError, match="dataset='sine'"):
        Params().check_config(SimpleNamespace(dataset="sine"))


# ------------------------------------------------------------------------------------------- end to end

def test_with_one_component_fedem_is_fedavg():
    kw = dict(clients=4, rounds=3, participation=0.5, local_epochs=2, clients_per_actor=2)
    pa = prepare(tiny(algo="fedavg", **kw))
    fedavg = Loop(pa, LocalRuntime(pa)).run()
    pe = prepare(tiny(algo="fedem", params={"M": 1}, **kw))
    fedem = Loop(pe, LocalRuntime(pe)).run()
    np.testing.assert_array_equal(fedem.server.components[0], fedavg.server.get([fedavg.server.global_ref])[0])
    for a, b in zip(fedavg.history, fedem.history):
        assert b.pop("pi_max_mean") == 1.0
        assert {k: v for k, v in a.items() if "seconds" not in k} == {k: v for k, v in b.items()
                                                                       if "seconds" not in k}
    assert len(fedavg.history) == len(fedem.history) == 3


def test_clients_of_different_latent_groups_end_with_different_pi():
    cfg = tiny(algo="fedem", clients=6, rounds=6, lr=0.3, local_epochs=2, partition="label-groups", groups=2,
               group_assign="blocks", params={"M": 2})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p)).run()
    groups = np.array(p.info.groups)
    pi = loop.server.artifacts()["pi"]
    assert pi.shape == (6, 2) and np.allclose(pi.sum(axis=1), 1.0)
    favourite = pi.argmax(axis=1)
    assert len(set(favourite[groups == 0])) == 1 and len(set(favourite[groups == 1])) == 1
    assert favourite[groups == 0][0] != favourite[groups == 1][0]  # one component per group
    gap = pi[groups == 0].mean(axis=0) - pi[groups == 1].mean(axis=0)
    assert abs(gap[0]) > 0.3
    host = loop.runtime.hosts[0]
    np.testing.assert_array_equal(np.stack([host.clients[c].state["pi"] for c in range(6)]), pi)
    assert loop.final["test_acc_mean"] > 0.8  # well above chance (10 classes)
