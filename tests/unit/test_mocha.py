"""MOCHA (Smith et al. 2017): Ω's closed form (Zhang & Yeung 2010) against scipy's matrix square root, the
coupling term against autograd of tr(WΩWᵀ), the proximal head step against its optimality condition, the
driver (body averaged, heads gathered, Ω on schedule), the client (shared body + own head, pulled to its
coupled neighbours as λ grows), and an end-to-end run on label-skewed data."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from conftest import tiny
from rayfl import training
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.mocha import (MochaClient, MochaParams, MochaServer, couplings, head_range, head_tensors,
                                    precision, prox_head, regularizer, task_covariance)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime


# ------------------------------------------------------------------------------------------- Ω's update

def test_task_covariance_matches_an_independent_matrix_square_root():
    W = np.array([[1.0, 0.5, -0.2, 0.0], [0.3, 1.2, 0.4, -0.7], [0.0, -0.3, 0.9, 0.2], [0.5, 0.1, 0.0, 1.1],
                  [-0.4, 0.2, 0.3, 0.6]])  # d = 5, m = 4, full column rank
    root = scipy.linalg.sqrtm(W.T @ W).real  # Schur-based square root, not the module's eigendecomposition
    expected = root / np.trace(root)
    sigma = task_covariance(W)
    np.testing.assert_allclose(sigma, expected, atol=1e-10)
    assert np.trace(sigma) == pytest.approx(1.0)
    np.testing.assert_array_equal(sigma, sigma.T)
    assert np.linalg.eigvalsh(sigma).min() > 0
    np.testing.assert_allclose(sigma @ sigma * np.trace(root) ** 2, W.T @ W, atol=1e-9)  # it is the root


def test_omega_is_the_inverse_of_the_covariance_on_hand_numbers():
    # orthogonal columns of norms 3 and 1: WᵀW = diag(9, 1), root diag(3, 1), Σ = diag(3/4, 1/4), Ω = diag(4/3, 4)
    W = np.array([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    sigma = task_covariance(W)
    np.testing.assert_allclose(sigma, np.diag([0.75, 0.25]), atol=1e-12)
    omega = precision(sigma)
    np.testing.assert_allclose(omega, np.diag([4 / 3, 4.0]), atol=1e-12)
    full = np.array([[0.5, 0.4], [0.4, 0.5]])  # det 0.09: inverse [[0.5, -0.4], [-0.4, 0.5]] / 0.09
    np.testing.assert_allclose(precision(full), np.array([[0.5, -0.4], [-0.4, 0.5]]) / 0.09, atol=1e-10)
    np.testing.assert_array_equal(precision(full), precision(full).T)


def test_eigenvalues_of_a_rank_deficient_gram_matrix_are_floored_at_1e_7():
    # columns 0 and 1 equal: WᵀW = [[1,1,0],[1,1,0],[0,0,4]], eigenvalues 0, 2, 4 -> floored 1e-7, 2, 4 (code)
    W = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    roots = np.sqrt([1e-7, 2.0, 4.0])
    sigma = task_covariance(W)
    np.testing.assert_allclose(np.linalg.eigvalsh(sigma), roots / roots.sum(), rtol=1e-7)
    omega = precision(sigma)
    assert np.all(np.isfinite(omega))
    np.testing.assert_allclose(omega @ sigma, np.eye(3), atol=1e-6)


# ------------------------------------------------------------------------------------------- the coupling

def test_couplings_on_hand_numbers():
    W = np.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]])
    omega = np.array([[2.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 2.0]])
    # c_0 = -1·(2,1) + 0·(3,0); c_1 = -1·(1,0) - 1·(3,0); c_2 = 0·(1,0) - 1·(2,1): never the task's own column
    np.testing.assert_allclose(couplings(W, omega), np.array([[-2.0, -4.0, -2.0], [-1.0, 0.0, -1.0]]))


def test_coupling_gives_autograds_gradient_of_the_trace_for_each_task():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(5, 4))
    a = rng.normal(size=(4, 4))
    omega = a @ a.T + np.eye(4)
    Wt = torch.tensor(W, requires_grad=True)
    torch.trace(Wt @ torch.tensor(omega) @ Wt.T).backward()
    C = couplings(W, omega)
    for t in range(4):  # ∂ tr(WΩWᵀ) / ∂w_t = 2 (Ω_tt w_t + c_t)
        np.testing.assert_allclose(2 * (omega[t, t] * W[:, t] + C[:, t]), Wt.grad[:, t].numpy(), atol=1e-10)


def test_regularizer_on_hand_numbers():
    W = np.array([[1.0, 2.0], [0.0, 1.0]])
    omega = np.array([[2.0, -1.0], [-1.0, 3.0]])
    # tr(WΩWᵀ) = Σ_st Ω_st w_sᵀw_t = 2·1 + 3·5 - 2·2 = 13; ||W||² = 6
    assert regularizer(W, omega, 0.5, 0.25) == pytest.approx(0.5 * 13 + 0.25 * 6)


def test_prox_head_solves_its_optimality_condition_against_autograd():
    rng = np.random.default_rng(1)
    W = rng.normal(size=(3, 3))
    a = rng.normal(size=(3, 3))
    omega = a @ a.T + np.eye(3)
    lam1, lam2, lr, t = 0.7, 0.3, 0.2, 1
    v = rng.normal(size=3)
    c = couplings(W, omega)[:, t]
    w = prox_head(torch.tensor(v), torch.tensor(c), float(omega[t, t]), lam1, lam2, lr).numpy()
    Wt = torch.tensor(W)
    Wt[:, t] = torch.tensor(w)
    Wt.requires_grad_(True)
    R = lam1 * torch.trace(Wt @ torch.tensor(omega) @ Wt.T) + lam2 * (Wt ** 2).sum()  # Eq. 2
    R.backward()
    np.testing.assert_allclose((w - v) / lr + Wt.grad[:, t].numpy(), 0.0, atol=1e-10)  # 0 ∈ ∂(r + ||w-v||²/2lr)
    # by hand: λ1 = 1, λ2 = 0, lr = 0.5, Ω_tt = 2, c = 1, v = 4 -> (4 - 2·0.5·1·1) / (1 + 2·0.5·2) = 1
    assert float(prox_head(torch.tensor(4.0), torch.tensor(1.0), 2.0, 1.0, 0.0, 0.5)) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------- knobs

def test_params_defaults_and_check():
    p = MochaParams()
    assert (p.lam1, p.lam2, p.omega_every) == (5e-5, 0.0, 0)  # code's λ/2 with λ = 1e-4; no λ2; 10 Ω updates
    MochaParams(lam1=0.0, lam2=0.0, omega_every=0).check(3)  # boundaries allowed
    MochaParams(lam1=10.0, lam2=1.0, omega_every=100).check(3)
    for bad, key in ((dict(lam1=-1e-3), "lam1"), (dict(lam2=-0.5), "lam2"), (dict(lam1=float("nan")), "lam1"),
                     (dict(lam2=float("inf")), "lam2"), (dict(omega_every=-1), "omega_every")):
        with pytest.raises(ValueError, match=f"{key}="):
            MochaParams(**bad).check(3)


# ------------------------------------------------------------------------------------------- driver

def make_server(m=3, rounds=4, n=(10, 30, 60), **params):
    info = RunInfo(n_clients=m, rounds=rounds, participation=1.0, seed=0, n_train=list(n))
    srv = MochaServer(MochaParams(**params), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                      initial=np.arange(7, dtype=np.float32))  # body: entries 0-4, head: entries 5-6
    srv.setup(lambda step, msgs: {0: {"start": 5, "stop": 7}} if step == "locate" else None)
    return srv


def fake_call(vecs, heads, sizes, sent):
    def call(step, msgs, reduce=None):  # the reduction the engine runs inside the client actors
        sent.update(msgs)
        return reduce_uploads(reduce, {c: {"weights": np.array(vecs[c], np.float32), "head": np.array(heads[c]),
                                           "n": sizes[c], "train_loss": 1.0} for c in msgs})
    return call


def test_setup_starts_every_head_at_the_initial_models_last_layer_and_omega_at_m_identity():
    srv = make_server()
    np.testing.assert_array_equal(srv.W, [[5.0, 5.0, 5.0], [6.0, 6.0, 6.0]])
    np.testing.assert_array_equal(srv.sigma, np.eye(3) / 3)  # Σ_0 = I/m, Ω_0 = m·I (authors' code)
    np.testing.assert_array_equal(srv.omega, np.eye(3) * 3)


def test_body_is_averaged_heads_are_gathered_and_each_client_gets_its_coupling():
    srv = make_server(omega_every=5)
    srv.W = np.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]])
    srv.omega = np.array([[2.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 2.0]])
    vecs = {0: [1, 0, 0, 0, 0, 7, 7], 1: [0, 1, 0, 0, 0, 8, 8], 2: [3, 3, 3, 0, 0, 9, 9]}
    heads = {0: [10.0, 11.0], 1: [20.0, 21.0], 2: [30.0, 31.0]}
    sent = {}
    metrics = srv.run_round(Stage("train", 4), 0, [0, 2], fake_call(vecs, heads, {0: 10, 1: 30, 2: 60}, sent))
    assert set(sent) == {0, 2}
    # c_t = Σ_{s≠t} Ω_ts w_s with the heads of before the round: c_0 = -(2, 1), c_2 = -(2, 1); Ω_tt = 2
    np.testing.assert_allclose(sent[0]["coupling"], [-2.0, -1.0])
    np.testing.assert_allclose(sent[2]["coupling"], [-2.0, -1.0])
    assert sent[0]["omega_tt"] == 2.0 and sent[2]["omega_tt"] == 2.0
    assert sent[0]["models"]["global"] is srv.initial
    # body: (10·(1,0,0) + 60·(3,3,3)) / 70, FedAvg over the participants
    np.testing.assert_allclose(srv.global_ref[:3], [190 / 70, 180 / 70, 180 / 70], rtol=1e-6)
    # heads: each participant's own, the absent client's kept
    np.testing.assert_array_equal(srv.W, [[10.0, 2.0, 30.0], [11.0, 1.0, 31.0]])
    assert metrics["omega_updated"] == 0.0 and metrics["train_loss"] == 1.0
    assert metrics["regularizer"] == pytest.approx(regularizer(srv.W, srv.omega, 5e-5, 0.0))
    assert srv.eval_messages(Stage("train", 4), 0, [0, 1, 2]) == {c: {"models": {"global": srv.global_ref}}
                                                                  for c in range(3)}


def test_omega_is_updated_from_the_gathered_heads_on_its_schedule():
    heads = {0: [1.0, 0.5], 1: [0.2, 1.5], 2: [0.9, 0.8]}
    vecs = {c: np.zeros(7) for c in range(3)}
    call = fake_call(vecs, heads, {0: 1, 1: 1, 2: 1}, {})
    srv = make_server(rounds=20)  # omega_every = 0: every 20 // 10 = 2 rounds
    m0 = srv.run_round(Stage("train", 20), 0, [0, 1, 2], call)
    np.testing.assert_array_equal(srv.omega, np.eye(3) * 3)
    m1 = srv.run_round(Stage("train", 20), 1, [0, 1, 2], call)
    W = np.array([heads[c] for c in range(3)]).T
    root = scipy.linalg.sqrtm(W.T @ W).real  # WᵀW is 3 x 3 of rank 2: its zero eigenvalue floored
    np.testing.assert_allclose(srv.sigma, root / np.trace(root), atol=1e-3)
    np.testing.assert_allclose(srv.omega @ srv.sigma, np.eye(3), atol=1e-6)
    assert (m0["omega_updated"], m1["omega_updated"]) == (0.0, 1.0)
    arts = srv.artifacts()
    assert set(arts) == {"omega", "task_covariance", "heads"}
    assert arts["omega"].shape == arts["task_covariance"].shape == (3, 3)
    np.testing.assert_array_equal(arts["omega"], srv.omega)
    np.testing.assert_array_equal(arts["heads"], [heads[c] for c in range(3)])  # one row per client
    assert srv.final_model() is srv.global_ref  # the shared body

    every3 = make_server(rounds=20, omega_every=3)
    updated = [every3.run_round(Stage("train", 20), r, [0, 1, 2], call)["omega_updated"] for r in range(6)]
    assert updated == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    short = make_server(rounds=4)  # fewer than 10 rounds: every round
    assert short.run_round(Stage("train", 4), 0, [0, 1, 2], call)["omega_updated"] == 1.0


def test_server_state_round_trips():
    srv = make_server()
    srv.run_round(Stage("train", 4), 0, [0, 1], fake_call({c: np.ones(7) * c for c in range(3)},
                                                           {c: [c, 2.0 * c] for c in range(3)}, {0: 1, 1: 2, 2: 3}, {}))
    other = make_server()
    other.load_state_dict(srv.state_dict())
    for key, value in srv.state_dict().items():
        np.testing.assert_array_equal(other.state_dict()[key], value)


# ------------------------------------------------------------------------------------------- client

def make():
    # body: 12 + 4 and 16 + 4 entries, head (the last layer): 8 + 2
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def tiny_client(lr=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 3, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:20], y[:20]), "val": (x[20:30], y[20:30]), "test": (x[30:], y[30:])}
    torch.manual_seed(seed)
    initial = training.to_vector(make())
    return Client(0, splits, make, initial, TrainSettings("classification", 1, lr, 32), seed)


def message(coupling, omega_tt):
    return {"coupling": np.asarray(coupling, np.float32), "omega_tt": omega_tt}


def test_locate_names_the_last_layer():
    assert MochaClient(MochaParams()).step_locate(tiny_client(), {}, {}) == {"start": 36, "stop": 46}


def test_the_head_is_the_last_layers_tensors_only():
    # a 1-entry bias just below the head: the body is entries 0-3, the head entries 4-7 (weight 2 x 1, bias 2)
    model = nn.Sequential(nn.Linear(3, 1), nn.ReLU(), nn.Linear(1, 2))
    assert head_range(model) == slice(4, 8)
    got = head_tensors(model, head_range(model))
    assert [t.data_ptr() for t in got] == [model[2].weight.data_ptr(), model[2].bias.data_ptr()]


def test_client_trains_the_shared_body_with_its_own_head():
    """Before it has trained, a client's head is the initial model's last layer; after, the head it trained,
    kept alone (its body is the shared one every round)."""
    client, logic = tiny_client(lr=0.0), MochaClient(MochaParams())
    initial = client.initial.numpy()
    shared = -np.arange(46, dtype=np.float32) / 10
    up = logic.step_train(client, message(np.zeros(10), 3.0), {"global": shared})
    np.testing.assert_array_equal(up["weights"], np.concatenate([shared[:36], initial[36:]]))  # lr = 0: as loaded
    own = np.arange(10, dtype=np.float32) / 100
    client.state["head"] = own
    up = logic.step_train(client, message(np.zeros(10), 3.0), {"global": shared})
    np.testing.assert_array_equal(up["weights"], np.concatenate([shared[:36], own]))
    np.testing.assert_array_equal(up["head"], own)
    np.testing.assert_array_equal(client.state["head"], own)
    assert up["n"] == 20 and client.weights() is None


def test_one_local_step_is_sgd_then_the_proximal_head_step():
    lam1, lam2, lr, omega_tt = 0.3, 0.2, 0.1, 2.5
    client, logic = tiny_client(lr=lr), MochaClient(MochaParams(lam1=lam1, lam2=lam2))
    shared = training.to_vector(make())
    c = np.linspace(-1.0, 1.0, 10)
    start = np.concatenate([shared[:36], client.vector()[36:]])
    up = logic.step_train(client, message(c, omega_tt), {"global": shared})  # batch 32 >= 20 samples: one step
    ref = training.load_vector(make(), start)  # the same step, by hand
    x, y = client.splits["train"]
    nn.functional.cross_entropy(ref(x), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy()
    v = start - lr * grad
    head = (v[36:] - 2 * lr * lam1 * c) / (1 + 2 * lr * (lam1 * omega_tt + lam2))
    np.testing.assert_allclose(up["weights"], np.concatenate([v[:36], head]), atol=1e-6)
    np.testing.assert_allclose(client.state["head"], head, atol=1e-6)


def test_a_strongly_coupled_head_moves_to_its_neighbours_conditional_mean():
    # two tasks with Σ = [[.5, .4], [.4, .5]]: Ω = [[.5, -.4], [-.4, .5]] / .09; as λ1 grows, client 0's head goes
    # to argmin_w Ω_00 ||w||² + 2 wᵀΩ_01 w_1 = -Ω_01 w_1 / Ω_00 = 0.8 w_1
    omega = np.array([[0.5, -0.4], [-0.4, 0.5]]) / 0.09
    w1 = np.linspace(0.5, -0.4, 10)
    target = 0.8 * w1
    client = tiny_client()
    start = client.vector()
    heads = {}
    for lam1 in (0.0, 1e6):
        client.state.pop("head", None)  # each from the initial head
        logic = MochaClient(MochaParams(lam1=lam1))
        heads[lam1] = logic.step_train(client, message(omega[0, 1] * w1, omega[0, 0]), {"global": start})["head"]
    np.testing.assert_allclose(heads[1e6], target, atol=1e-4)
    assert np.linalg.norm(heads[0.0] - target) > 0.5  # uncoupled, it stays its own


def test_evaluation_uses_the_shared_body_and_own_head_and_leaves_the_client_as_it_was():
    client, logic = tiny_client(), MochaClient(MochaParams())
    own = np.linspace(-1, 1, 46).astype(np.float32)
    client.state["head"] = own[36:].copy()
    shared = np.linspace(1, -1, 46).astype(np.float32)
    gen, rng = client.gen.get_state(), client.rng.bit_generator.state
    rec = logic.step_evaluate(client, {}, {"global": shared})
    expected = client.evaluate(client.new_model(np.concatenate([shared[:36], own[36:]])))
    assert rec == expected
    assert rec != client.evaluate(client.new_model(own)) and rec != client.evaluate(client.new_model(shared))
    np.testing.assert_array_equal(client.state["head"], own[36:])
    assert client.weights() is None  # its head alone is its own
    assert torch.equal(client.gen.get_state(), gen) and client.rng.bit_generator.state == rng


# ------------------------------------------------------------------------------------------- behaviour

def test_learns_on_label_skewed_data_where_fedavg_does_not_and_learns_omega():
    def run(algo):
        p = prepare(tiny(algo=algo, clients=6, rounds=8, partition="pathological", classes_per_client=2))
        return Loop(p, LocalRuntime(p)).run()

    mocha, fedavg = run("mocha"), run("fedavg")
    assert mocha.final["test_acc_mean"] > 0.9 and mocha.final["test_acc_mean"] > fedavg.final["test_acc_mean"] + 0.1
    assert [h["omega_updated"] for h in mocha.history] == [1.0] * 8  # 8 rounds: Ω updated every round
    sigma = mocha.server.artifacts()["task_covariance"]
    assert np.trace(sigma) == pytest.approx(1.0) and not np.allclose(sigma, np.eye(6) / 6)
    heads = mocha.server.W
    assert not np.allclose(heads, heads[:, :1])  # one head per client, not averaged


def test_sample_level_dp_covers_its_training_and_user_level_is_refused():
    """FedFomo's Table 3 has a DP MOCHA row: the local training is DP-SGD (rayfl.privacy), the proximal head step
    post-processes it; user-level DP cannot cover it (the heads are uploaded one by one, not summed)."""
    from rayfl.config import UserError

    p = prepare(tiny(algo="mocha", clients=4, rounds=2, dp_level="sample", dp_noise=1.0, dp_clip=1.0))
    loop = Loop(p, LocalRuntime(p)).run()
    assert loop.final["dp_epsilon_max"] > 0 and loop.final["test_acc_mean"] == loop.final["test_acc_mean"]
    with pytest.raises(UserError, match="algo='mocha': dp_level=user"):
        prepare(tiny(algo="mocha", dp_level="user", dp_noise=1.0, dp_clip=1.0))
