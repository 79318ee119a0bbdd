"""pFedMe (T. Dinh et al. 2020): the K-step inner solve against its closed form on a quadratic loss, the local
and global updates (β ≠ 1), R local rounds from the run's local work, which clients train and which upload,
that θ_i (not w_i, not the global model) is evaluated, and a non-IID run whose personalized accuracy is not its
global one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.pfedme import (PFedMeClient, PFedMeParams, PFedMeServer, global_update, local_rounds,
                                     local_update, solve_inner)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime

RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(6, 2)), RNG.normal(size=(6, 1))
A = np.hstack([X, np.ones((6, 1))])  # Linear(2, 1)'s vector is (a1, a2, b): predictions A v
H, G = 2 / 6 * A.T @ A, 2 / 6 * A.T @ Y[:, 0]  # mean squared error: f(v) = mean((A v − y)²), ∇f(v) = H v − G


def k_step_iterate(theta0, w, lam, nu, K):
    """Gradient descent on h(θ) = f(θ) + λ/2 ||θ − w||², an affine map θ ← M θ + c with M = I − ν (H + λ I),
    c = ν (G + λ w); after K steps θ_K = M^K θ_0 + (I − M^K)(I − M)^{-1} c."""
    M = np.eye(3) - nu * (H + lam * np.eye(3))
    c = nu * (G + lam * w)
    MK = np.linalg.matrix_power(M, K)
    return MK @ theta0 + (np.eye(3) - MK) @ np.linalg.solve(np.eye(3) - M, c)


def test_inner_solve_against_the_closed_form_of_a_quadratic():
    w, theta0 = np.array([0.5, -1.0, 0.2]), np.array([1.0, 1.0, -1.0])
    p = PFedMeParams(lam=2.0, K=3, personal_lr=0.1)
    theta, loss = solve_inner(nn.Linear(2, 1).double(), torch.tensor(theta0), torch.tensor(w), torch.tensor(X),
                              torch.tensor(Y), p, F.mse_loss)
    np.testing.assert_allclose(theta.numpy(), k_step_iterate(theta0, w, 2.0, 0.1, 3), rtol=1e-10)
    assert loss.item() == pytest.approx(np.mean((A @ theta.numpy() - Y[:, 0]) ** 2), rel=1e-10)  # f(θ̃; D)
    # many steps: the minimiser of Eq. 7, (H + λ I)^{-1} (G + λ w), the proximal point of w
    theta, _ = solve_inner(nn.Linear(2, 1).double(), torch.tensor(theta0), torch.tensor(w), torch.tensor(X),
                           torch.tensor(Y), PFedMeParams(lam=2.0, K=400, personal_lr=0.1), F.mse_loss)
    np.testing.assert_allclose(theta.numpy(), np.linalg.solve(H + 2.0 * np.eye(3), G + 2.0 * w), rtol=1e-8)


def test_inner_solve_in_a_flattened_models_own_weights_against_the_closed_form():
    """The client's path: θ is the working model's own flat weights, updated in place with nothing copied."""
    from rayfl import training

    w, theta0 = np.array([0.5, -1.0, 0.2]), np.array([1.0, 1.0, -1.0])
    model = training.flatten(nn.Linear(2, 1).double())
    training.load_vector(model, torch.tensor(theta0))
    own = training.flat_weights(model)
    theta, loss = solve_inner(model, own, torch.tensor(w), torch.tensor(X), torch.tensor(Y),
                              PFedMeParams(lam=2.0, K=3, personal_lr=0.1), F.mse_loss)
    assert theta is own
    np.testing.assert_allclose(theta.numpy(), k_step_iterate(theta0, w, 2.0, 0.1, 3), rtol=1e-10)
    assert loss.item() == pytest.approx(np.mean((A @ theta.numpy() - Y[:, 0]) ** 2), rel=1e-10)


def test_local_update_moves_w_towards_theta_by_eta_lambda():
    # w − η λ (w − θ) with η = 0.1, λ = 2: (1, 2) − 0.2·((1, 2) − (0, 4)) = (0.8, 2.4)
    got = local_update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0]), 0.1, 2.0)
    np.testing.assert_allclose(got.numpy(), [0.8, 2.4], rtol=1e-6)


def test_global_update_with_beta():
    # (1 − β) w + β·mean: β = 0.5: 0.5·(1, 2) + 0.5·(4, 3) = (2.5, 2.5); β = 2: −(1, 2) + 2·(4, 3) = (7, 4)
    w = np.array([1.0, 2.0], np.float32)
    np.testing.assert_allclose(global_update(w, np.array([4.0, 3.0]), 0.5), [2.5, 2.5])
    np.testing.assert_allclose(global_update(w, np.array([4.0, 3.0]), 2.0), [7.0, 4.0])
    assert global_update(w, np.array([4.0, 3.0]), 1.0).dtype == np.float32


def test_local_rounds_follow_the_runs_batches_or_R():
    assert local_rounds(20, 4, 1, 0) == 5 and local_rounds(21, 4, 2, 0) == 12  # ⌈n / B⌉ a pass
    assert local_rounds(20, 4, 3, 20) == 20  # the paper's fixed R
    assert local_rounds(0, 4, 3, 20) == 0


# ------------------------------------------------------------------------------------------- client

def regression_client(n_train=6, epochs=1, lr=0.05, batch_size=32, model=lambda: nn.Linear(2, 1), size=3):
    """A Linear(2, 1) client on the quadratic above (its training split is (X, Y)); batches hold the whole split."""
    x = torch.tensor(np.vstack([X, RNG.normal(size=(4, 2))]), dtype=torch.float32)
    y = torch.tensor(np.vstack([Y, RNG.normal(size=(4, 1))]), dtype=torch.float32)
    splits = {"train": (x[:n_train], y[:n_train]), "val": (x[6:8], y[6:8]), "test": (x[8:], y[8:])}
    settings = TrainSettings("regression", epochs, lr, batch_size)
    return Client(1, splits, model, np.zeros(size, np.float32), settings, 0)


def reference_round(w_t, lam, nu, K, eta, R):
    """Algorithm 1 in numpy: θ warm-starts at w_t, then from the last θ̃; w_{r+1} = w_r − η λ (w_r − θ̃).
    Also the mean over the rounds of f(θ̃; D)."""
    w, theta, losses = w_t.copy(), w_t.copy(), []
    for _ in range(R):
        theta = k_step_iterate(theta, w, lam, nu, K)
        losses.append(np.mean((A @ theta - Y[:, 0]) ** 2))
        w = w - eta * lam * (w - theta)
    return w, theta, np.mean(losses)


def test_a_clients_local_rounds_follow_algorithm_1():
    """Three epochs of one full batch: R = 3 local rounds, each K = 2 inner steps then the local update with
    η = the run's lr; the client keeps the last θ̃ as its model and uploads w_{i,R} when sampled."""
    client = regression_client(epochs=3, lr=0.07)
    p = PFedMeParams(lam=3.0, K=2, personal_lr=0.05)
    w_t = np.array([0.2, -0.3, 0.1], np.float32)
    up = PFedMeClient(p).step_train(client, {"upload": True}, {"global": w_t})
    w_R, theta_R, loss = reference_round(w_t.astype(np.float64), 3.0, 0.05, 2, 0.07, 3)
    np.testing.assert_allclose(up["weights"], w_R, rtol=1e-5)
    np.testing.assert_allclose(client.weights(), theta_R, rtol=1e-5)  # θ_i, not w_i
    assert (up["rounds"], up["n"], up["one"]) == (3, 6, 1)
    assert up["train_loss"] == pytest.approx(loss, rel=1e-5)
    quiet = PFedMeClient(p).step_train(regression_client(), {"upload": False}, {"global": w_t})
    assert "weights" not in quiet and "one" not in quiet  # trained (θ_i moves on) but not sampled
    empty = regression_client(n_train=0)
    up = PFedMeClient(p).step_train(empty, {"upload": True}, {"global": w_t})
    assert up["rounds"] == 0 and math.isnan(up["train_loss"]) and empty.weights() is None
    np.testing.assert_array_equal(up["weights"], w_t)


class LinearWithBuffer(nn.Linear):
    """Linear(2, 1) and a float buffer its forward pass never reads: a vector (a1, a2, b, buffer)."""

    def __init__(self):
        super().__init__(2, 1)
        self.register_buffer("unused", torch.zeros(1))


def test_a_model_with_buffers_follows_algorithm_1_on_its_parameters_and_keeps_its_buffers():
    """θ is a copy of w when the vector holds buffers (a forward pass could move them): the same local rounds
    as a model without, the buffer's entry carried unchanged."""
    client = regression_client(epochs=3, lr=0.07, model=LinearWithBuffer, size=4)
    p = PFedMeParams(lam=3.0, K=2, personal_lr=0.05)
    w_t = np.array([0.2, -0.3, 0.1, 7.0], np.float32)
    up = PFedMeClient(p).step_train(client, {"upload": True}, {"global": w_t})
    w_R, theta_R, _ = reference_round(w_t[:3].astype(np.float64), 3.0, 0.05, 2, 0.07, 3)
    np.testing.assert_allclose(up["weights"], [*w_R, 7.0], rtol=1e-5)
    np.testing.assert_allclose(client.weights(), [*theta_R, 7.0], rtol=1e-5)


def test_theta_is_evaluated_not_w_nor_the_global_model():
    client = regression_client(epochs=3)
    logic = PFedMeClient(PFedMeParams(lam=3.0, K=2, personal_lr=0.05))
    w_t = np.array([0.2, -0.3, 0.1], np.float32)
    up = logic.step_train(client, {"upload": True}, {"global": w_t})
    gen, rng, theta = client.gen.get_state().clone(), dict(client.rng.bit_generator.state), client.weights()
    rec = logic.step_evaluate(client, {}, {"global": w_t})

    def mse(vec, split):
        x, y = client.splits[split]
        with torch.no_grad():
            return float(F.mse_loss(client.new_model(vec)(x), y))

    for split in ("val", "test"):
        assert rec[f"{split}_loss"] == pytest.approx(mse(theta, split), rel=1e-6)
    assert rec["global_model_loss"] == pytest.approx(mse(w_t, "test"), rel=1e-6) and rec["n_global_model"] == 2
    others = {mse(up["weights"], "test"), mse(w_t, "test")}  # w_{i,R} and w_t score otherwise
    assert all(abs(o - rec["test_loss"]) > 1e-4 for o in others)
    # evaluation leaves the client as it was
    assert torch.equal(client.gen.get_state(), gen) and client.rng.bit_generator.state == rng
    np.testing.assert_array_equal(client.weights(), theta)


# ------------------------------------------------------------------------------------------- server

def make_server(beta=0.5, train_all=True, n=4):
    info = RunInfo(n_clients=n, rounds=2, participation=0.5, seed=0, n_train=[10] * n)
    return PFedMeServer(PFedMeParams(beta=beta, train_all=train_all), info, put=lambda v: np.array(v), get=list,
                        rng=np.random.default_rng(0), initial=np.array([1.0, 2.0], np.float32))


def fake_call(sent):
    def call(step, msgs, reduce=None):
        sent.update(msgs)
        ups = {c: {"rounds": 3, "n": [10, 30, 10, 10][c], "train_loss": float(c)} for c in msgs}
        for c, m in msgs.items():
            if m["upload"]:
                ups[c].update(weights=np.array([[3.0, 5.0], [5.0, 1.0], [0, 0], [9.0, 9.0]][c], np.float32), one=1)
        return reduce_uploads(reduce, ups)

    return call


@pytest.mark.parametrize("beta, expect", [(0.5, [2.5, 2.5]), (2.0, [7.0, 4.0])])
def test_every_client_trains_the_sampled_upload_and_the_server_moves_by_beta(beta, expect):
    """Participants 0 and 1 upload (3, 5) and (5, 1): plain mean (4, 3), whatever their sizes (10 and 30);
    w = (1 − β)(1, 2) + β (4, 3). Clients 2 and 3 train too (Algorithm 1) but do not upload."""
    srv, sent = make_server(beta), {}
    start = srv.global_ref
    metrics = srv.run_round(Stage("train", 2), 0, [0, 1], fake_call(sent))
    assert {c: m["upload"] for c, m in sent.items()} == {0: True, 1: True, 2: False, 3: False}
    assert all(np.array_equal(m["models"]["global"], start) for m in sent.values())
    np.testing.assert_allclose(srv.global_ref, expect, rtol=1e-6)
    assert metrics["trained_clients"] == 4 and metrics["local_rounds_mean"] == 3
    assert metrics["train_loss"] == pytest.approx((0 * 10 + 1 * 30) / 40)  # over the sampled clients
    msgs = srv.eval_messages(Stage("train", 2), 0, [0, 3])
    assert set(msgs) == {0, 3} and msgs[3]["models"]["global"] is srv.global_ref
    assert srv.final_model() is srv.global_ref
    back = make_server(beta)
    back.load_state_dict(srv.state_dict())
    np.testing.assert_array_equal(back.global_ref, srv.global_ref)
    back.run_round(Stage("train", 2), 1, [0, 1], fake_call({}))
    srv.run_round(Stage("train", 2), 1, [0, 1], fake_call({}))
    np.testing.assert_array_equal(back.global_ref, srv.global_ref)  # the restored server goes on the same


def test_without_train_all_only_the_sampled_clients_train():
    srv, sent = make_server(1.0, train_all=False), {}
    metrics = srv.run_round(Stage("train", 2), 0, [1, 3], fake_call(sent))
    assert {c: m["upload"] for c, m in sent.items()} == {1: True, 3: True}
    np.testing.assert_allclose(srv.global_ref, [7.0, 5.0])  # β = 1: the plain mean of (5, 1) and (9, 9)
    assert metrics["trained_clients"] == 2


# ------------------------------------------------------------------------------------------- knobs

def test_params_check_and_config():
    PFedMeParams().check(2)
    PFedMeParams(beta=2.0, R=20, train_all=False).check(2)
    PFedMeParams(K=1, R=0, beta=0.1).check(2)  # boundaries: one inner step, R from the run
    for bad in (dict(lam=0.0), dict(lam=float("nan")), dict(personal_lr=-0.1), dict(personal_lr=float("inf")),
                dict(beta=0.0), dict(beta=float("nan")), dict(K=0), dict(R=-1)):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))}="):
            PFedMeParams(**bad).check(2)
    ok = SimpleNamespace(optimizer="sgd", momentum=0.0, weight_decay=0.0)
    PFedMeParams().check_config(ok)
    for key, value in (("optimizer", "adam"), ("momentum", 0.9), ("weight_decay", 1e-4)):
        with pytest.raises(ValueError, match=f"^{key}="):
            PFedMeParams().check_config(SimpleNamespace(**{**vars(ok), key: value}))


def test_paper_defaults():
    """The paper's MNIST comparison: λ = 15, K = 5, ν = 0.09, β = 1; R from the run; every client trains."""
    p = PFedMeParams()
    assert (p.lam, p.K, p.personal_lr, p.beta, p.R, p.train_all) == (15.0, 5, 0.09, 1.0, 0, True)


# ------------------------------------------------------------------------------------------- a whole run

def test_on_non_iid_data_the_personalized_models_beat_the_global_one():
    """Two classes per client, the paper's knobs: each θ_i fits its client's classes, the global model w is a
    compromise."""
    p = prepare(tiny(algo="pfedme", partition="pathological", clients=4, rounds=6, participation=0.5))
    loop = Loop(p, LocalRuntime(p)).run()
    final = loop.final
    assert final["test_acc_mean"] > 0.8
    assert final["test_acc_mean"] > final["global_model_acc_mean"] + 0.1
    assert loop.history[0]["trained_clients"] == 4  # participation 0.5, yet every client runs its local rounds


def test_the_inner_solves_gradient_norms_are_eq7s_at_its_start_and_end():
    """||∇h(θ)|| = ||H θ − G + λ (θ − w)|| on the quadratic loss, at θ_0 and at the K-step iterate."""
    theta0, w = np.array([0.3, -0.2, 0.1]), np.array([1.0, 0.5, -0.5])
    lam, nu, K = 2.0, 0.05, 4
    p = PFedMeParams(lam=lam, K=K, personal_lr=nu)
    _, _, start, end = solve_inner(nn.Linear(2, 1).double(), torch.tensor(theta0), torch.tensor(w), torch.tensor(X),
                                   torch.tensor(Y), p, F.mse_loss, measure=True)
    grad_h = lambda t: H @ t - G + lam * (t - w)  # noqa: E731
    assert start == pytest.approx(np.linalg.norm(grad_h(theta0)), rel=1e-9)
    assert end == pytest.approx(np.linalg.norm(grad_h(k_step_iterate(theta0, w, lam, nu, K))), rel=1e-9)
    assert end < start  # ν (λ + largest eigenvalue of H) < 2: gradient descent on h approaches its minimiser


def test_a_step_past_two_over_the_curvature_does_not_settle_and_the_server_says_so_once():
    """ν (λ + L) > 2: each step overshoots the minimiser of h by more than it started from, so ||∇h|| grows.
    The server counts such clients, warns once naming personal_lr, and logs the norm."""
    top = np.linalg.eigvalsh(H).max()
    lam, K = 15.0, 5
    nu = 2.5 / (lam + top)  # past the stable step 2 / (λ + L)
    theta0, w = np.zeros(3), np.array([1.0, 0.5, -0.5])
    _, _, start, end = solve_inner(nn.Linear(2, 1).double(), torch.tensor(theta0), torch.tensor(w), torch.tensor(X),
                                   torch.tensor(Y), PFedMeParams(lam=lam, K=K, personal_lr=nu), F.mse_loss,
                                   measure=True)
    assert end > start
    info = RunInfo(n_clients=2, rounds=2, participation=1.0, seed=0, n_train=[4, 4], task="classification")
    server = PFedMeServer(PFedMeParams(lam=lam, personal_lr=nu), info, lambda v: v, lambda refs: refs,
                          np.random.default_rng(0), np.zeros(3, dtype=np.float32))
    ups = {0: {"rounds": 1, "n": 4, "train_loss": 0.5, "weights": np.ones(3, np.float32), "one": 1,
               "inner_grad_start": start, "inner_grad_end": end},
           1: {"rounds": 1, "n": 4, "train_loss": 0.5, "weights": np.ones(3, np.float32), "one": 1,
               "inner_grad_start": 2.0, "inner_grad_end": 0.5}}
    call = lambda step, messages, reduce=None: reduce_uploads(reduce, ups)  # noqa: E731
    metrics = server.run_round(Stage("train", 2), 0, [0, 1], call)
    assert metrics["inner_unsettled"] == 1 and metrics["inner_grad_norm"] == pytest.approx((end + 0.5) / 2)
    [warning] = server.warnings()
    assert "did not settle on 1 of 2 clients" in warning and f"personal_lr={nu:g}" in warning
    server.run_round(Stage("train", 2), 1, [0, 1], call)
    assert server.warnings() == []  # said once a run


def test_a_run_whose_inner_solve_overshoots_shows_the_warning_on_the_console_once(capsys):
    from rayfl.inprocess import run_in_process
    from rayfl.progress import ConsoleProgress

    console = ConsoleProgress()
    cfg = tiny(algo="pfedme", rounds=3, lr=0.01, params={"personal_lr": 0.15, "lam": 15.0})  # ν·λ = 2.25
    out = run_in_process(prepare(cfg), None, on_round=lambda e: console({**e, "event": "round", "time": 0.0}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rayfl: warning: pfedme")]
    assert len(lines) == 1 and "personal_lr=0.15 with lam=15" in lines[0]
    assert out["history"][0]["inner_unsettled"] > 0
