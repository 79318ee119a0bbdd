"""FedProx (Li et al., MLSys 2020): the proximal gradient of Eq. 2 on hand-computed numbers, one local step of a
model whose gradient is known by hand (fast flat path and torch-optimizer path), μ = 0 is exactly FedAvg, a
larger μ keeps the trained weights closer to the global model, and the run learns end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny
from rayfl import training
from rayfl.algorithms import get_algorithm
from rayfl.algorithms.baselines import FedAvgServer
from rayfl.algorithms.fedprox import (FedProxClient, FedProxParams, ProximalOptimizer, add_proximal_gradient,
                                      trainable_mask)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- the math

def test_proximal_gradient_eq2_on_hand_numbers():
    # ∇F + μ(w − w^t) with μ = 0.5: (1, -2, 0.5) + 0.5·((1, 2, 3) − (0, 4, 3)) = (1.5, -3, 0.5)
    grad = t(1.0, -2.0, 0.5)
    out = add_proximal_gradient(grad, t(1.0, 2.0, 3.0), t(0.0, 4.0, 3.0), 0.5)
    assert out is grad  # in place
    torch.testing.assert_close(grad, t(1.5, -3.0, 0.5))
    # the mask keeps the term off the second entry (not a trainable parameter): (1.5, -2, 0.5)
    grad = t(1.0, -2.0, 0.5)
    add_proximal_gradient(grad, t(1.0, 2.0, 3.0), t(0.0, 4.0, 3.0), 0.5, trainable=t(1.0, 0.0, 1.0))
    torch.testing.assert_close(grad, t(1.5, -2.0, 0.5))


def linear_step(model: nn.Module, optimizer_of, mu: float) -> np.ndarray:
    """One SGD step (lr 0.1) on h(w; w^t) for Linear(2, 1) under MSE on the one sample x = (1, 2), y = 0, from
    w = (1, 1 | 0) with w^t = (0.5, -1 | 0.25) (weights | bias): returns the weights after the step."""
    training.load_vector(model, np.array([0.5, -1.0, 0.25], np.float32))
    opt = ProximalOptimizer(optimizer_of(model), model, mu)  # w^t: the weights now
    training.load_vector(model, np.array([1.0, 1.0, 0.0], np.float32))  # w moved away from w^t
    x, y = t(1.0, 2.0).reshape(1, 2), t(0.0).reshape(1, 1)
    training.train_epochs(model, x, y, 1, 1, opt, nn.functional.mse_loss, torch.Generator().manual_seed(0))
    return training.to_vector(model)


# By hand: prediction 1·1 + 1·2 + 0 = 3, loss (3 − 0)², so ∇F = 2·3·(x, 1) = (6, 12 | 6); with μ = 2 the
# proximal gradient is 2·((1, 1 | 0) − (0.5, -1 | 0.25)) = (1, 4 | -0.5), in all (7, 16 | 5.5), and the step
# w − 0.1·(7, 16 | 5.5) = (0.3, -0.6 | -0.55). Without the proximal term: (1, 1 | 0) − 0.1·(6, 12 | 6).
BY_HAND = [0.3, -0.6, -0.55]
WITHOUT_PROX = [0.4, -0.2, -0.6]


def test_one_step_of_the_flat_sgd_path_on_hand_numbers():
    model = training.flatten(nn.Linear(2, 1))
    opt_of = lambda m: training.optimizer_for(m, "sgd", 0.1)  # noqa: E731
    assert isinstance(opt_of(model), training.FlatSGD)  # the fast path is the one tested here
    np.testing.assert_allclose(linear_step(model, opt_of, 2.0), BY_HAND, rtol=1e-6)
    np.testing.assert_allclose(linear_step(model, opt_of, 0.0), WITHOUT_PROX, rtol=1e-6)


def test_one_step_of_a_torch_optimizer_on_hand_numbers():
    model = nn.Linear(2, 1)  # not flattened: torch's SGD and the per-tensor path
    opt_of = lambda m: training.optimizer_for(m, "sgd", 0.1)  # noqa: E731
    assert isinstance(opt_of(model), torch.optim.SGD)
    np.testing.assert_allclose(linear_step(model, opt_of, 2.0), BY_HAND, rtol=1e-6)
    np.testing.assert_allclose(linear_step(model, opt_of, 0.0), WITHOUT_PROX, rtol=1e-6)


def test_adam_sees_the_proximal_gradient():
    # Adam's first step is -lr·sign(g) (m̂/√v̂ = g/|g|): with ∇F = (6, 12 | 6) and μ = 40 the proximal gradient
    # 40·(0.5, 2 | -0.25) = (20, 80 | -10) flips the bias entry's sign (6 − 10 < 0): (1, 1, 0) − 0.01·(1, 1, -1)
    model = training.flatten(nn.Linear(2, 1))
    out = linear_step(model, lambda m: training.optimizer_for(m, "adam", 0.01), 40.0)
    np.testing.assert_allclose(out, [0.99, 0.99, 0.01], rtol=1e-4)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("stat", torch.zeros(1))

    def forward(self, x):
        return self.lin(x) + self.stat


def test_the_proximal_term_leaves_buffers_and_frozen_parameters_alone():
    model = training.flatten(WithBuffer())  # flat vector (state_dict order): buffer (1), weight (2), bias (1)
    assert trainable_mask(model).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert trainable_mask(training.flatten(nn.Linear(2, 1))) is None  # all trainable: no mask
    model.lin.bias.requires_grad_(False)
    assert trainable_mask(model).tolist() == [0.0, 1.0, 1.0, 0.0]
    training.load_vector(model, np.zeros(4, np.float32))
    opt = ProximalOptimizer(training.optimizer_for(model, "sgd", 0.1), model, 5.0)  # w^t = 0
    training.load_vector(model, np.array([3.0, 1.0, 0.0, 2.0], np.float32))  # buffer, weight and bias moved
    opt.zero_grad()
    model(torch.zeros(1, 2)).sum().mul(0).backward()  # ∇F = 0
    opt.step()
    # only the trainable weight feels the pull back to w^t: 1 − 0.1·5·(1 − 0) = 0.5
    np.testing.assert_allclose(training.to_vector(model), [3.0, 0.5, 0.0, 2.0])


# ------------------------------------------------------------------------------------------- client side

def two_sample_client(lr=0.1):
    """Linear(1, 1) under MSE on two copies of (x, y) = (1, 0): every minibatch of one sample has the same
    gradient 2·(w·1 + b)·(1, 1), whatever the order."""
    x, y = t(1.0, 1.0).reshape(2, 1), t(0.0, 0.0).reshape(2, 1)
    splits = {"train": (x, y), "val": (x, y), "test": (x, y)}
    settings = TrainSettings("regression", 1, lr, 1)
    return Client(0, splits, lambda: nn.Linear(1, 1), np.zeros(2, np.float32), settings, 0)


def test_client_trains_from_the_global_model_on_the_proximal_objective():
    client = two_sample_client()
    w_t = np.array([1.0, 0.5], np.float32)  # (weight, bias)
    up = FedProxClient(FedProxParams(mu=3.0)).step_train(client, {}, {"global": w_t})
    # By hand, lr 0.1, two steps of one sample, g(w) = 2(a + b)·(1, 1) plus 3·(w − w^t):
    # step 1 at w^t: g = 2·1.5·(1, 1) = (3, 3), no proximal part: w1 = (0.7, 0.2)
    # step 2: 2·0.9·(1, 1) + 3·((0.7, 0.2) − (1, 0.5)) = (1.8, 1.8) + (-0.9, -0.9): w2 = (0.61, 0.11)
    np.testing.assert_allclose(up["weights"], [0.61, 0.11], rtol=1e-5)
    assert up["n"] == 2
    assert client._weights is None  # a FedAvg client: no personal model kept


def test_a_larger_mu_keeps_the_trained_weights_closer_to_the_global_model():
    w_t = np.array([1.0, 0.5], np.float32)
    dist = []
    for mu in (0.0, 0.5, 2.0, 8.0):
        client = two_sample_client(lr=0.05)
        client.splits["train"] = (client.splits["train"][0].repeat(10, 1), client.splits["train"][1].repeat(10, 1))
        up = FedProxClient(FedProxParams(mu=mu)).step_train(client, {}, {"global": w_t})
        dist.append(float(np.linalg.norm(up["weights"] - w_t)))
    assert all(a > b for a, b in zip(dist, dist[1:])), dist
    assert dist[-1] < 0.5 * dist[0]


# ------------------------------------------------------------------------------------------- knobs and wiring

def test_params_check():
    assert FedProxParams().mu == 1.0  # the paper's μ for Synthetic, MNIST and FEMNIST
    FedProxParams(mu=0.0).check(3)
    FedProxParams(mu=1.0).check(3)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"mu={bad}"):
            FedProxParams(mu=bad).check(3)


def test_registered_with_fedavgs_server_and_evaluated_on_the_global_model():
    algo = get_algorithm("fedprox")
    assert algo.Server is FedAvgServer and algo.ClientLogic is FedProxClient
    g = np.ones(3, np.float32)
    assert FedProxClient(FedProxParams()).eval_weights({}, {"global": g}) is g


# ------------------------------------------------------------------------------------------- end to end

def run(algo, **kw):
    p = prepare(tiny(algo=algo, rounds=5, participation=0.67, **kw))
    return Loop(p, LocalRuntime(p)).run()


def test_mu_zero_is_exactly_fedavg_and_fedprox_learns():
    fedavg, prox0 = run("fedavg"), run("fedprox", params={"mu": 0.0})
    np.testing.assert_array_equal(prox0.server.global_ref, fedavg.server.global_ref)
    assert prox0.final["test_acc_mean"] == fedavg.final["test_acc_mean"]
    prox = run("fedprox", params={"mu": 1.0})
    assert not np.array_equal(prox.server.global_ref, fedavg.server.global_ref)
    assert prox.final["test_acc_mean"] > 0.4  # 10 classes: chance is 0.1
