"""A user's own models (registered factories, torchvision's by name) and models with BatchNorm: their
statistics averaged with the weights (``buffers=global``) or kept by each client (``buffers=local``, FedBN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import rayfl
from rayfl import models, training
from rayfl.config import UserError
from rayfl.data import datasets as D
from rayfl.experiment import prepare

from conftest import tiny


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    for name in [n for n in models.MODELS if n.startswith("t-")]:
        del models.MODELS[name]
    for name in [n for n in D._REGISTRY if n.startswith("t-")]:
        del D._REGISTRY[name]
    D._LAST.clear()


def bn_first(shape, k):
    """BatchNorm on the raw features with momentum 1: after one full-batch epoch its running mean is exactly the
    mean of the training data it saw, which the tests compute on their own."""
    return nn.Sequential(nn.BatchNorm1d(shape[0], momentum=1.0), nn.Linear(shape[0], 8), nn.ReLU(), nn.Linear(8, k))


def two_hospitals():
    rng = np.random.default_rng(0)
    owner = np.repeat([0, 1], 120)
    x = rng.normal(size=(240, 4)).astype(np.float32) + np.where(owner[:, None] == 1, 3.0, -1.0).astype(np.float32)
    y = rng.integers(0, 2, 240)
    return {"x": x, "y": y, "client": owner}


def run_one_round(buffers: str):
    from rayfl.loop import Loop
    from rayfl.runtime import LocalRuntime

    data = two_hospitals()
    rayfl.register_dataset("t-hospitals", lambda: data, standardize=False)
    rayfl.register_model("t-bn-first", bn_first)
    p = prepare(tiny(dataset="t-hospitals", model="t-bn-first", partition="natural", clients=2, rounds=1,
                     samples_per_client=0, batch_size=1000, buffers=buffers))
    loop = Loop(p, LocalRuntime(p), [], None)
    loop.run()
    clients = {cid: c for h in loop.runtime.hosts for cid, c in h.clients.items()}
    own_means = [data["x"][p.federation.clients[i].train].astype(np.float64).mean(0) for i in range(2)]
    return p, loop, clients, own_means


def running_mean(model) -> np.ndarray:
    return model[0].running_mean.detach().numpy().astype(np.float64)


def test_local_buffers_stay_with_each_client():
    p, loop, clients, own = run_one_round("local")
    glob = loop.server.get([loop.server.global_ref])[0]
    assert not np.allclose(own[0], own[1], atol=1.0)  # the two hospitals' data differ
    for cid in (0, 1):
        np.testing.assert_allclose(clients[cid].buffers()[:4], own[cid], atol=1e-5)
        # what the client is evaluated with, and trains from next round: the global weights, its own statistics
        for model in (clients[cid].model_of(glob), clients[cid].scratch(glob)):
            np.testing.assert_allclose(running_mean(model), own[cid], atol=1e-5)
            np.testing.assert_array_equal(model[1].weight.detach().numpy(),
                                          training.load_vector(bn_first((4,), 2), glob)[1].weight.detach().numpy())


def test_global_buffers_are_the_weighted_average():
    p, loop, clients, own = run_one_round("global")
    glob = training.load_vector(bn_first((4,), 2), loop.server.get([loop.server.global_ref])[0])
    n = np.array([len(c.train) for c in p.federation.clients], dtype=np.float64)
    np.testing.assert_allclose(running_mean(glob), (n[0] * own[0] + n[1] * own[1]) / n.sum(), atol=1e-5)
    for cid in (0, 1):
        assert clients[cid].buffers() is None
        np.testing.assert_allclose(running_mean(clients[cid].model_of(loop.server.get([loop.server.global_ref])[0])),
                                   running_mean(glob), atol=0)


def test_local_buffers_need_an_algorithm_that_declares_them():
    with pytest.raises(UserError, match=r"^buffers='local': algo='fedfomo' does not declare"):
        tiny(algo="fedfomo", buffers="local").check()
    with pytest.raises(UserError, match=r"^buffers='shared': unknown; allowed: global, local"):
        tiny(buffers="shared").check()


def test_weight_decay_leaves_batchnorm_statistics_alone():
    model = training.flatten(nn.Sequential(nn.BatchNorm1d(3, momentum=0.0), nn.Linear(3, 2)))
    before = model[0].running_var.clone()
    opt = training.FlatSGD(model, lr=0.5, weight_decay=0.1)
    w = model[1].weight.detach().clone()
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    training.train_epochs(model, x, y, 2, 8, opt, nn.functional.cross_entropy, torch.Generator().manual_seed(0))
    torch.testing.assert_close(model[0].running_var, before, rtol=0, atol=0)  # momentum 0: only decay could move it
    assert not torch.equal(model[1].weight, w)


def test_sizing_a_pass_does_not_touch_batchnorm_statistics():
    model = training.flatten(bn_first((4,), 2))
    before = training.to_vector(model)
    training.pass_size(model, torch.ones(5, 4), 1024)  # one dummy sample: in training mode BN would fold it in
    np.testing.assert_array_equal(training.to_vector(model), before)
    assert model.training


def test_a_model_of_the_wrong_width_is_refused_before_ray(monkeypatch, capsys):
    import rayfl.api
    from rayfl.cli import main

    rayfl.register_model("t-seven", lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 7)))
    with pytest.raises(UserError, match=r"^model='t-seven': gives outputs of shape \(7,\) per sample; dataset "
                                        r"'synthetic' needs 10 \(classes\)$"):
        prepare(tiny(model="t-seven"))
    monkeypatch.setattr(rayfl.session, "start_ray", lambda *a: pytest.fail("Ray started"))
    assert main(["run", "--dataset", "synthetic", "--model", "t-seven", "--clients", "2", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfl: error: model='t-seven': gives outputs") and err.count("\n") == 1, err


@pytest.mark.parametrize("factory, message", [
    (lambda shape, k: "not a module", r"its factory returned a str, not a torch nn.Module"),
    (lambda shape, k: nn.Linear(3, k), r"does not fit dataset 'synthetic' of shape \(32,\): RuntimeError"),
    (lambda shape, k: 1 / 0, r"does not fit dataset 'synthetic' .*ZeroDivisionError"),
    (lambda shape, k: nn.Sequential(nn.BatchNorm1d(shape[0], momentum=None), nn.Linear(shape[0], k)),
     r"layer '0' \(BatchNorm1d\) has momentum=None"),
])
def test_a_bad_factory_is_one_line(factory, message):
    rayfl.register_model("t-bad", factory)
    with pytest.raises(UserError, match=r"^model='t-bad'.*" + message) as err:
        prepare(tiny(model="t-bad"))
    assert "\n" not in str(err.value)


def test_torchvision_models_take_the_dataset_channels_and_classes():
    model = models.build_model("torchvision:resnet18", (1, 8, 8), 10)
    assert model.conv1.in_channels == 1 and model.fc.out_features == 10
    model.eval()
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    p = prepare(tiny(dataset="digits", model="torchvision:resnet18", partition="iid", clients=2))
    assert p.info.n_params == training.to_vector(model).size  # BatchNorm's statistics travel in the vector
    with pytest.raises(UserError, match=r"^model='torchvision:resnet1': torchvision has no classification model "
                                        r"'resnet1' \(did you mean torchvision:resnet18"):
        tiny(model="torchvision:resnet1").check()


def test_register_model_takes_a_declaration_and_refuses_builtin_names():
    models.register_model(models.ModelSource("t-decl", bn_first))
    assert models.build_model("t-decl", (4,), 3)[3].out_features == 3
    with pytest.raises(UserError, match=r"^model='lenet5': a built-in model"):
        rayfl.register_model("lenet5", bn_first)
    with pytest.raises(UserError, match=r"must be a non-empty name without ':'"):
        rayfl.register_model("torchvision:x", bn_first)
