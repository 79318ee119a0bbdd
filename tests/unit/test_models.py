"""Every model builds from the input shape, gives (B, outputs), and initializes deterministically."""

import pytest
import torch

from rayfl.config import UserError
from rayfl.data import Dataset
from rayfl.models import MODELS, build_model, default_model

IMAGES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
TABULAR = [(64,), (32,), (1,)]
CONVS = ("mcmahan-cnn", "tf-cnn", "lenet5")


def shapes(name):
    return IMAGES if name in CONVS else IMAGES + TABULAR


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_shape(name):
    for shape in shapes(name):
        for outputs in (1, 10):
            model = build_model(name, shape, outputs)
            assert model(torch.randn(3, *shape)).shape == (3, outputs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deterministic_init_no_batchnorm(name):
    shape = (1, 8, 8)
    torch.manual_seed(0)
    a = build_model(name, shape, 10).state_dict()
    torch.manual_seed(0)
    b = build_model(name, shape, 10).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in build_model(name, shape, 3).modules())


def test_published_sizes():
    def flat_in(model):  # input size of the first Linear layer
        return next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).in_features

    assert sum(p.numel() for p in build_model("mcmahan-cnn", (1, 28, 28), 10).parameters()) == 1663370
    assert flat_in(build_model("tf-cnn", (3, 32, 32), 10)) == 1024
    assert flat_in(build_model("lenet5", (3, 32, 32), 10)) == 400
    assert flat_in(build_model("lenet5", (1, 28, 28), 10)) == 256


def test_errors():
    with pytest.raises(UserError, match="model='nope'"):
        build_model("nope", (1, 8, 8), 10)
    for name in CONVS:
        with pytest.raises(UserError, match="needs image inputs"):
            build_model(name, (64,), 10)


def test_default_model():
    def ds(name, shape):
        return Dataset(name, None, None, "classification", 10, shape)

    assert default_model(ds("digits", (1, 8, 8))) == "mlp-small"
    assert default_model(ds("synthetic", (32,))) == "mlp-small"
    assert default_model(ds("mnist", (1, 28, 28))) == "mcmahan-cnn"
    assert default_model(ds("fashion-mnist", (1, 28, 28))) == "mcmahan-cnn"
    assert default_model(ds("cifar100", (3, 32, 32))) == "tf-cnn"
    assert default_model(ds("sine", (1,))) == "sine-mlp"
    assert all(default_model(ds(n, (1, 8, 8))) in MODELS for n in ("cifar10", "other"))
