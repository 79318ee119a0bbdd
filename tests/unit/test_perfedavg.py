"""Per-FedAvg (Fallah et al. 2020): the FO step against a hand computation, the HF step's Hessian-vector product
against torch.autograd's double backward, evaluation adapting on the training split only (and leaving the client
as it was), the plain mean of the uploaded global-model copies, and a run that personalizes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny
from rayfl import training
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.perfedavg import (Batches, PerFedAvgClient, PerFedAvgParams, PerFedAvgServer, gradient,
                                        hessian_vector_product, local_steps, meta_step)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime


class Fixed:
    """Batches handed out in a given order (D, D', D''), counting how many were taken."""

    def __init__(self, *batches):
        self.batches, self.taken = list(batches), 0

    def next(self):
        self.taken += 1
        return self.batches[self.taken - 1]


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


# ------------------------------------------------------------------------------------------- FO and HF steps

def test_fo_step_against_a_hand_computation():
    """Linear(2, 1) with the mean squared error; vector = (a1, a2, b). With w = 0:
    D  = {((1, 0), 1), ((0, 1), 2)}: residuals r = (-1, -2), ∇f(w, D) = (2/2)·(Σ r x, Σ r) = (-1, -2, -3);
         α = 0.1: w̃ = (0.1, 0.2, 0.3).
    D' = {((1, 1), 0)}: r = 0.1 + 0.2 + 0.3 = 0.6, ∇f(w̃, D') = 2·0.6·(1, 1, 1) = (1.2, 1.2, 1.2);
         β = 0.5: w − β ∇f(w̃, D') = (-0.6, -0.6, -0.6)."""
    model = nn.Linear(2, 1)
    batches = Fixed((t([[1, 0], [0, 1]]), t([[1], [2]])), (t([[1, 1]]), t([[0]])))
    p = PerFedAvgParams(inner_lr=0.1, outer_lr=0.5, variant="fo")
    w, loss = meta_step(model, torch.zeros(3), batches, p, F.mse_loss)
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.6, -0.6], rtol=1e-6)
    assert loss.item() == pytest.approx(0.36)  # f(w̃, D') = 0.6²: the meta-objective's sample
    assert batches.taken == 2  # FO reads D and D' only


def test_fo_step_matches_numpy_on_random_batches():
    """The same rule, written in numpy for random batches: D for the inner step, D' for the outer one."""
    rng = np.random.default_rng(0)
    (x1, y1), (x2, y2) = [(rng.normal(size=(5, 3)), rng.normal(size=(5, 1))) for _ in range(2)]
    w = rng.normal(size=4)  # (a1, a2, a3, b)

    def grad(v, x, y):
        r = x @ v[:3] + v[3] - y[:, 0]
        return 2 / len(r) * np.concatenate([x.T @ r, [r.sum()]])

    w_tilde = w - 0.3 * grad(w, x1, y1)
    expect = w - 0.7 * grad(w_tilde, x2, y2)
    batches = Fixed(*[(torch.tensor(a), torch.tensor(b)) for a, b in ((x1, y1), (x2, y2))])
    got, _ = meta_step(nn.Linear(3, 1).double(), torch.tensor(w), batches, PerFedAvgParams(0.3, 0.7, "fo"), F.mse_loss)
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-10)


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def exact(model, w, x, y):
    """The loss as a function of the flat vector, for torch.autograd (independent of the code under test)."""
    shapes = [(name, p.shape) for name, p in model.named_parameters()]

    def loss_of(v):
        params, offset = {}, 0
        for name, shape in shapes:
            n = math.prod(shape)
            params[name] = v[offset:offset + n].view(shape)
            offset += n
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    return loss_of


def exact_hvp(model, w, u, x, y):
    """∇²f(w) u by double backward."""
    v = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(exact(model, w, x, y)(v), v, create_graph=True)
    (hv,) = torch.autograd.grad(g @ u, v)
    return hv


def test_hf_hessian_vector_product_against_double_backward_shrinks_with_delta():
    model = small_net()
    gen = torch.Generator().manual_seed(1)
    n = sum(p.numel() for p in model.parameters())
    w, u = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    x, y = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    truth = exact_hvp(model, w, u, x, y)
    errors = [float((hessian_vector_product(lambda v: gradient(model, v, x, y, F.cross_entropy)[1], w, u, d)
                     - truth).norm()) for d in (1e-1, 1e-2, 1e-3)]
    # central differences: the error is O(δ²), two orders of magnitude per decade of δ
    assert errors[1] < errors[0] / 30 and errors[2] < errors[1] / 30 and errors[2] < 1e-4 * float(truth.norm())
    assert errors[0] > 1e-6  # the approximation is one (a test that cannot tell it from the truth checks nothing)


def test_hf_step_uses_the_third_batch_at_w_in_the_direction_of_the_outer_gradient():
    """w − β (g − α ∇²f(w, D'') g), g = ∇f(w − α ∇f(w, D), D'), against autograd (δ small: O(δ²) apart)."""
    model = small_net()
    gen = torch.Generator().manual_seed(2)
    n = sum(p.numel() for p in model.parameters())
    w = torch.randn(n, generator=gen, dtype=torch.float64)
    D = [(torch.randn(6, 3, generator=gen, dtype=torch.float64), torch.randint(0, 3, (6,), generator=gen))
         for _ in range(3)]
    alpha, beta = 0.5, 0.8

    def grad(v, batch):
        v = v.clone().requires_grad_(True)
        return torch.autograd.grad(exact(model, w, *batch)(v), v)[0]

    g = grad(w - alpha * grad(w, D[0]), D[1])
    expect = w - beta * (g - alpha * exact_hvp(model, w, g, *D[2]))
    batches = Fixed(*D)
    got, _ = meta_step(model, w, batches, PerFedAvgParams(alpha, beta, "hf", delta=1e-4), F.cross_entropy)
    assert batches.taken == 3
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-8)
    fo = w - beta * g  # the HF correction is not negligible here, so the check above tells HF from FO
    assert float((fo - expect).norm()) > 1e-2


# ------------------------------------------------------------------------------------------- local work

def test_local_steps_follow_the_runs_passes_or_tau():
    # 20 samples in batches of 4: 5 batches an epoch; FO takes 2 a step (2 steps), HF 3 (1 step)
    assert local_steps(20, 4, 1, "fo", 0) == 2 and local_steps(20, 4, 3, "fo", 0) == 6
    assert local_steps(20, 4, 2, "hf", 0) == 2
    assert local_steps(24, 4, 1, "hf", 0) == 2 and local_steps(24, 4, 1, "fo", 0) == 3  # 6 batches: 3 or 2 a step
    assert local_steps(21, 4, 1, "fo", 0) == 3  # 6 batches, the last of one sample
    assert local_steps(3, 4, 2, "hf", 0) == 2  # fewer batches than a step needs: still one step an epoch
    assert local_steps(20, 4, 1, "fo", 10) == 10  # the paper's fixed τ
    assert local_steps(0, 4, 5, "fo", 10) == 0  # nothing to train on


def test_batches_are_disjoint_within_a_pass_and_a_new_permutation_follows():
    x, y = torch.arange(10).float()[:, None], torch.arange(10)
    b = Batches(x, y, 4, torch.Generator().manual_seed(0))
    first = [b.next()[1].tolist() for _ in range(3)]
    assert [len(s) for s in first] == [4, 4, 2] and sorted(sum(first, [])) == list(range(10))
    second = b.next()[1].tolist()
    assert len(second) == 4 and len(set(second)) == 4
    again = Batches(x, y, 4, torch.Generator().manual_seed(0))  # seeded: the same stream
    assert [again.next()[1].tolist() for _ in range(3)] == first
    even = Batches(x[:8], y[:8], 4, torch.Generator().manual_seed(0))  # a pass ends exactly: no empty batch
    assert [len(even.next()[1]) for _ in range(5)] == [4, 4, 4, 4, 4]


def test_adaptation_batch_is_a_batch_of_samples_or_the_whole_smaller_split():
    from rayfl.algorithms.perfedavg import adaptation_batch

    x, y = torch.arange(30).float().reshape(10, 3), torch.arange(10)
    xb, yb = adaptation_batch(x, y, 4, torch.Generator().manual_seed(0))
    assert len(yb) == 4 and len(set(yb.tolist())) == 4 and torch.equal(xb, x[yb])
    xs, ys = adaptation_batch(x[:3], y[:3], 4, torch.Generator().manual_seed(0))
    assert torch.equal(ys, y[:3]) and torch.equal(xs, x[:3])  # the whole split, as it is
    assert torch.equal(adaptation_batch(x[:4], y[:4], 4, torch.Generator().manual_seed(0))[1], y[:4])


@pytest.mark.parametrize("flat", [False, True], ids=["module", "flattened"])
def test_flat_gradient_follows_the_weight_vector_with_zeros_where_nothing_is_trained(flat):
    """A buffer, a frozen parameter and a parameter the forward pass never uses get 0; the others their
    gradient, in rayfl.training.to_vector's order; the model is put in training mode first. Both paths: a
    module as it is, and one flattened into one buffer (the gradient then lands in a flat buffer too)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 1)
            self.register_buffer("scale", torch.tensor([2.0]))
            self.frozen = nn.Parameter(torch.tensor([3.0]), requires_grad=False)
            self.unused = nn.Parameter(torch.tensor([4.0]))

        def forward(self, x):
            return self.a(x) * self.scale * self.frozen

    model = training.flatten(Net()).eval() if flat else Net().eval()
    assert (getattr(model, "_rayfl_flat", None) is not None) == flat
    vec = torch.tensor([3.0, 4.0, 2.0, 0.5, -1.0, 0.25])  # state_dict order: frozen, unused, scale, a.weight, a.bias
    assert training.to_vector(training.load_vector(model, vec)).tolist() == vec.tolist()
    loss, grad = gradient(model, vec, t([[1.0, 2.0]]), t([[0.0]]), F.mse_loss)
    # prediction 6·(0.5 − 2 + 0.25) = −7.5; loss 56.25; ∂/∂(a) = 2·(−7.5)·6·(1, 2, 1) = (−90, −180, −90)
    assert loss.item() == pytest.approx(56.25)
    np.testing.assert_allclose(grad.numpy(), [0.0, 0.0, 0.0, -90.0, -180.0, -90.0], rtol=1e-6)
    assert model.training
    gradient(model, vec, t([[2.0, 0.0]]), t([[0.0]]), F.mse_loss)  # another gradient leaves the first as it was
    np.testing.assert_allclose(grad.numpy(), [0.0, 0.0, 0.0, -90.0, -180.0, -90.0], rtol=1e-6)


# ------------------------------------------------------------------------------------------- clients

def linear_client(n_train=6, batch_size=8, seed=0, flip=True):
    """A Linear(2, 2) classifier client whose val/test labels are the *opposite* of its training labels, so that
    adapting on val or test moves the model elsewhere than adapting on train."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + 8, 2, generator=g)
    y = (x[:, 0] > 0).long()
    if flip:
        y[n_train:] = 1 - y[n_train:]
    splits = {"train": (x[:n_train], y[:n_train]), "val": (x[n_train:n_train + 4], y[n_train:n_train + 4]),
              "test": (x[n_train + 4:], y[n_train + 4:])}
    settings = TrainSettings("classification", 1, 0.1, batch_size)
    return Client(3, splits, lambda: nn.Linear(2, 2), np.zeros(6, np.float32), settings, seed)


def ce_gradient(w, x, y):
    """∇ of the mean cross-entropy of Linear(2, 2) at w = (W row-major, b): (softmax − onehot)ᵀ [x, 1] / n."""
    W, b = w[:4].reshape(2, 2), w[4:]
    z = x @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return np.concatenate([(p.T @ x).reshape(-1), p.sum(0)]) / len(y)


def test_evaluation_adapts_on_the_training_split_only():
    """θ = w − α ∇f(w, train) (the whole training split: it is smaller than a batch), computed here in numpy;
    the record is θ's on val and test. Adapting on val or test instead would land elsewhere (their labels are
    flipped) and give another record."""
    client = linear_client()
    logic = PerFedAvgClient(PerFedAvgParams(inner_lr=0.5))
    w = np.array([0.3, -0.2, 0.1, 0.4, 0.05, -0.05], np.float32)
    rec = logic.step_evaluate(client, {"seed": 0, "round": 4}, {"global": w})
    xs = {s: (client.splits[s][0].numpy().astype(np.float64), client.splits[s][1].numpy()) for s in client.splits}
    theta = w - 0.5 * ce_gradient(w.astype(np.float64), *xs["train"])
    want = client.evaluate(client.new_model(theta.astype(np.float32)))
    for key in ("val_loss", "test_loss", "val_acc", "test_acc", "n_val", "n_test"):
        assert rec[key] == pytest.approx(want[key], rel=1e-5), key
    for leak in ("val", "test"):  # what a leak would report
        wrong = client.evaluate(client.new_model((w - 0.5 * ce_gradient(w.astype(np.float64), *xs[leak]))
                                                 .astype(np.float32)))
        assert abs(wrong["test_loss"] - rec["test_loss"]) > 1e-3
    glob = client.evaluate(client.new_model(w), ("test",))  # the un-adapted global model, as an extra split
    assert (rec["global_model_loss"], rec["global_model_acc"], rec["n_global_model"]) == \
        pytest.approx((glob["test_loss"], glob["test_acc"], glob["n_test"]))
    assert abs(rec["global_model_loss"] - rec["test_loss"]) > 1e-3


def one_hot_client(n_train=40, batch_size=5):
    """Every sample its own input unit (x_i = e_i) for a Linear(N, 2) at w = 0: one gradient step moves exactly
    the weight columns of the samples in the batch, so the adapted model shows which samples it used."""
    n = n_train + 8
    x, y = torch.eye(n), torch.arange(n) % 2
    splits = {"train": (x[:n_train], y[:n_train]), "val": (x[n_train:n_train + 4], y[n_train:n_train + 4]),
              "test": (x[n_train + 4:], y[n_train + 4:])}
    settings = TrainSettings("classification", 1, 0.1, batch_size)
    return Client(5, splits, lambda: nn.Linear(n, 2), np.zeros(2 * n + 2, np.float32), settings, 0)


def batch_used(client, theta):
    """The samples whose weight columns one step moved."""
    n = client.splits["train"][0].shape[1]
    return set(np.flatnonzero(np.abs(theta.numpy()[:2 * n].reshape(2, n)).sum(0)).tolist())


def test_evaluation_batch_is_one_training_batch_seeded_by_run_client_and_round():
    """With more training samples than a batch, D_eval is ``batch_size`` of them (never a val/test sample, whose
    columns are 40..47), drawn from (seed, client, round): the same whatever the client's own streams did,
    another for another round or seed."""
    client = one_hot_client()
    logic = PerFedAvgClient(PerFedAvgParams(inner_lr=1.0))
    w = {"global": np.zeros(2 * 48 + 2, np.float32)}
    used = batch_used(client, logic.personalize(client, {"seed": 0, "round": 1}, w))
    assert len(used) == 5 and used <= set(range(40))
    first = logic.step_evaluate(client, {"seed": 0, "round": 1}, w)
    torch.randperm(7, generator=client.gen), client.rng.random()  # the client's own streams move on
    assert logic.step_evaluate(client, {"seed": 0, "round": 1}, w) == first
    assert batch_used(client, logic.personalize(client, {"seed": 0, "round": 1}, w)) == used
    others = [batch_used(client, logic.personalize(client, m, w)) for m in ({"seed": 0, "round": 2},
                                                                             {"seed": 1, "round": 1})]
    assert all(len(o) == 5 and o <= set(range(40)) and o != used for o in others)
    another = one_hot_client()
    another.cid = 6
    assert batch_used(another, logic.personalize(another, {"seed": 0, "round": 1}, w)) != used


def test_a_client_with_one_training_sample_adapts_on_it_and_one_with_none_does_not():
    client = one_hot_client(n_train=1)
    logic = PerFedAvgClient(PerFedAvgParams(inner_lr=1.0))
    w = {"global": np.zeros(2 * 9 + 2, np.float32)}
    assert batch_used(client, logic.personalize(client, {"seed": 0, "round": 1}, w)) == {0}
    empty = one_hot_client(n_train=0)
    np.testing.assert_array_equal(logic.personalize(empty, {"seed": 0, "round": 1}, w).numpy(), w["global"])


def test_evaluation_leaves_the_client_exactly_as_it_was():
    client = linear_client(n_train=40, batch_size=5)
    logic = PerFedAvgClient(PerFedAvgParams(inner_lr=1.0))
    gen, rng = client.gen.get_state().clone(), dict(client.rng.bit_generator.state)
    logic.step_evaluate(client, {"seed": 0, "round": 0}, {"global": np.ones(6, np.float32)})
    assert torch.equal(client.gen.get_state(), gen) and client.rng.bit_generator.state == rng
    assert client.weights() is None and client.state == {}  # no personal weights: the global model is the model


def test_client_trains_a_copy_of_the_global_model_and_keeps_nothing():
    """τ steps of Algorithm 1 from the message's global model, batches from the client's generator: the upload is
    what the same steps give from a generator in the same state; the client keeps no weights of its own."""
    client = linear_client(n_train=40, batch_size=5, flip=False)
    client.set_weights(np.full(6, 9.0, np.float32))  # a personal model, which training must not start from
    p = PerFedAvgParams(inner_lr=0.2, outer_lr=0.5, variant="fo")
    w = np.array([0.3, -0.2, 0.1, 0.4, 0.05, -0.05], np.float32)
    gen = torch.Generator()
    gen.set_state(client.gen.get_state())
    up = PerFedAvgClient(p).step_train(client, {}, {"global": w})
    assert up["steps"] == 4 and up["n"] == 40 and up["one"] == 1  # 8 batches of 5, 2 a step
    batches, expect, losses = Batches(*client.splits["train"], 5, gen), torch.tensor(w), []
    for _ in range(4):
        expect, loss = meta_step(nn.Linear(2, 2), expect, batches, p, F.cross_entropy)
        losses.append(loss.item())
    np.testing.assert_allclose(up["weights"], expect.numpy(), rtol=1e-6)
    assert up["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    np.testing.assert_array_equal(client.weights(), np.full(6, 9.0, np.float32))  # untouched
    empty = linear_client(n_train=0)
    rec = PerFedAvgClient(p).step_evaluate(empty, {"seed": 0, "round": 0}, {"global": w})
    assert rec["test_loss"] == pytest.approx(empty.evaluate(empty.new_model(w))["test_loss"])  # nothing to adapt on
    up = PerFedAvgClient(p).step_train(empty, {}, {"global": w})
    assert up["steps"] == 0 and math.isnan(up["train_loss"])
    np.testing.assert_array_equal(up["weights"], w)


# ------------------------------------------------------------------------------------------- server

def make_server(n=3, seed=7):
    info = RunInfo(n_clients=n, rounds=2, participation=1.0, seed=seed, n_train=[10, 30, 60][:n])
    return PerFedAvgServer(PerFedAvgParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                           initial=np.zeros(2, np.float32))


def test_the_global_model_is_the_plain_mean_of_the_uploads():
    srv = make_server()
    vecs, sent = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [3.0, 3.0]}, {}

    def call(step, msgs, reduce=None):
        sent.update(msgs)
        return reduce_uploads(reduce, {c: {"weights": np.array(vecs[c], np.float32), "one": 1, "steps": 2,
                                           "n": [10, 30, 60][c], "train_loss": float(c)} for c in msgs})

    start = srv.global_ref
    metrics = srv.run_round(Stage("train", 2), 0, [0, 1, 2], call)
    # Algorithm 1: (1/3)·((1,0) + (0,1) + (3,3)) = (4/3, 4/3); the size-weighted mean would be (1.9, 2.1)
    np.testing.assert_allclose(srv.global_ref, [4 / 3, 4 / 3], rtol=1e-6)
    assert set(sent) == {0, 1, 2} and all(m["models"]["global"] is start for m in sent.values())
    assert metrics["train_loss"] == pytest.approx((0 * 10 + 1 * 30 + 2 * 60) / 100)
    assert metrics["local_steps_mean"] == 2
    msgs = srv.eval_messages(Stage("train", 2), 1, [0, 2])
    assert set(msgs) == {0, 2} and msgs[0]["models"]["global"] is srv.global_ref
    assert (msgs[0]["seed"], msgs[0]["round"]) == (7, 1)
    assert srv.final_model() is srv.global_ref
    back = make_server()
    back.load_state_dict(srv.state_dict())
    np.testing.assert_array_equal(back.global_ref, srv.global_ref)


# ------------------------------------------------------------------------------------------- knobs

def test_params_check_and_config():
    PerFedAvgParams().check(2)
    PerFedAvgParams(variant="hf", tau=10).check(2)
    for bad in (dict(inner_lr=0.0), dict(inner_lr=float("nan")), dict(outer_lr=-1.0), dict(outer_lr=float("inf")),
                dict(delta=0.0), dict(delta=float("nan")), dict(variant="so"), dict(tau=-1)):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))}="):
            PerFedAvgParams(**bad).check(2)
    ok = SimpleNamespace(optimizer="sgd", momentum=0.0, weight_decay=0.0)
    PerFedAvgParams().check_config(ok)
    for key, value in (("optimizer", "adam"), ("momentum", 0.9), ("weight_decay", 1e-4)):
        with pytest.raises(ValueError, match=f"^{key}="):
            PerFedAvgParams().check_config(SimpleNamespace(**{**vars(ok), key: value}))


def test_paper_defaults():
    """The paper's experiments: α = β = δ = 0.001, first-order by default, τ from the run's local work."""
    p = PerFedAvgParams()
    assert (p.inner_lr, p.outer_lr, p.variant, p.delta, p.tau) == (0.001, 0.001, "fo", 0.001, 0)


# ------------------------------------------------------------------------------------------- a whole run

@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_a_run_learns_and_one_step_personalizes(variant):
    """Two classes per client: the global model is a compromise; one step on a client's own training data
    lifts it well above what the global model scores on that client's test split."""
    p = prepare(tiny(algo="perfedavg", partition="pathological", clients=4, rounds=8, samples_per_client=80,
                     params={"variant": variant, "inner_lr": 0.1, "outer_lr": 0.1}))
    loop = Loop(p, LocalRuntime(p)).run()
    final = loop.final
    assert final["test_acc_mean"] > 0.8
    assert final["test_acc_mean"] > final["global_model_acc_mean"] + 0.05
