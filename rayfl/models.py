"""The models the papers use, each sized from the dataset's input shape.

No BatchNorm anywhere: averaging running statistics across clients is out of scope, and FedFomo's tf_cnn,
McMahan's CNN and FedMoE's LeNet have none. Convolutional models add padding only when an input is too small
for the paper's layout (8x8 digits), so 28x28 and 32x32 inputs get the published layer sizes exactly.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from rayfl.config import UserError


def _flat(shape: tuple) -> int:
    return int(math.prod(shape))


def _image(name: str, shape: tuple) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise UserError(f"model={name!r}: needs image inputs (C, H, W); this dataset's inputs have shape {shape}")
    return shape  # type: ignore[return-value]


def _conv_net(name: str, shape: tuple, features: Callable[[int, int], list[nn.Module]], pads: tuple[int, ...],
              head: Callable[[int], list[nn.Module]]) -> nn.Sequential:
    """features(channels, pad) for the first padding in pads whose output is non-empty, then head(flat)."""
    c, h, w = _image(name, shape)
    for pad in pads:
        trial = nn.Sequential(*features(c, pad))
        try:
            with torch.no_grad():
                flat = trial(torch.zeros(1, c, h, w)).numel()
        except RuntimeError:
            continue
        if flat > 0:
            break
    else:
        raise UserError(f"model={name!r}: input {shape} is too small for it")
    return nn.Sequential(*features(c, pad), nn.Flatten(), *head(flat))  # fresh layers: init order fixed


def mcmahan_cnn(input_shape: tuple, num_outputs: int) -> nn.Module:
    """McMahan et al. 2017 CNN (spec 000 §3 "Architecture details": conv5x5 32, pool, conv5x5 64, pool, FC 512,
    out; 'same' padding as in TensorFlow, ~1.66M parameters on MNIST)."""
    def features(c, pad):
        return [nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]

    return _conv_net("mcmahan-cnn", input_shape, features, (2,),
                     lambda flat: [nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, num_outputs)])


def tf_cnn(input_shape: tuple, num_outputs: int) -> nn.Module:
    """FedFomo's code default `--arch tf_cnn` (spec 000 §3): conv3x3 32, pool, conv3x3 64, pool, conv3x3 64,
    FC 64, out; unpadded (1024 features on 32x32, 576 on 28x28), padded by 1 for 8x8 inputs."""
    def features(c, pad):
        return [nn.Conv2d(c, 32, 3, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(64, 64, 3, padding=pad), nn.ReLU()]

    return _conv_net("tf-cnn", input_shape, features, (0, 1),
                     lambda flat: [nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_outputs)])


def lenet5(input_shape: tuple, num_outputs: int) -> nn.Module:
    """LeNet-5 as in FedMoE's code (spec 001 §4.1) and user-centric FL (spec 003): conv5x5 6, pool, conv5x5 16,
    pool, FC 120, FC 84, out; unpadded (400 features on 32x32, 256 on 28x28), padded by 2 for 8x8 inputs.
    FedMoE's dropout after fc1 is left out."""
    def features(c, pad):
        return [nn.Conv2d(c, 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2)]

    return _conv_net("lenet5", input_shape, features, (0, 2),
                     lambda flat: [nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                   nn.Linear(84, num_outputs)])


def mlp_784_100(input_shape: tuple, num_outputs: int) -> nn.Module:
    """One hidden layer of 100 ReLU units (the classic MNIST MLP; input size from the data)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), 100), nn.ReLU(), nn.Linear(100, num_outputs))


def mlp_784_200(input_shape: tuple, num_outputs: int) -> nn.Module:
    """One hidden layer of 200 ReLU units (the MLP of the platform benchmarks, benchmarks/bench_peers.py)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), 200), nn.ReLU(), nn.Linear(200, num_outputs))


def mlp_small(input_shape: tuple, num_outputs: int) -> nn.Module:
    """One hidden layer of 64 ReLU units: enough for digits and the synthetic mixture, cheap on 2 cores."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), 64), nn.ReLU(), nn.Linear(64, num_outputs))


def sine_mlp(input_shape: tuple, num_outputs: int) -> nn.Module:
    """FedeRiCo's sine toy (spec 002 §5.2): each client fits a LINEAR model h(x) = a*x + b to its interval of
    the curve, so this is one Linear layer; the personalization, not the model, is meant to bend the fit."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), num_outputs))


def logreg(input_shape: tuple, num_outputs: int) -> nn.Module:
    """Multinomial logistic regression (a linear model on the flattened input)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), num_outputs))


MODELS: dict[str, Callable[[tuple, int], nn.Module]] = {
    "mcmahan-cnn": mcmahan_cnn,
    "tf-cnn": tf_cnn,
    "lenet5": lenet5,
    "mlp-784-100": mlp_784_100,
    "mlp-784-200": mlp_784_200,
    "mlp-small": mlp_small,
    "sine-mlp": sine_mlp,
    "logreg": logreg,
}

_DEFAULTS = {"digits": "mlp-small", "synthetic": "mlp-small", "mnist": "mcmahan-cnn",
             "fashion-mnist": "mcmahan-cnn", "cifar10": "tf-cnn", "cifar100": "tf-cnn", "sine": "sine-mlp"}


def build_model(name: str, input_shape: tuple, num_outputs: int) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"model={name!r}: unknown; allowed: {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), int(num_outputs))


def default_model(ds) -> str:
    """The model for cfg.model == "auto": the one the papers pair with the dataset."""
    if ds.name in _DEFAULTS:
        return _DEFAULTS[ds.name]
    return "mlp-small" if len(ds.input_shape) == 1 else "lenet5"
