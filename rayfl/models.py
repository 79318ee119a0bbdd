"""The models the papers use, each sized from the dataset's input shape.

No BatchNorm in the built-in models: FedFomo's tf_cnn, McMahan's CNN and FedMoE's LeNet have none. A user's
model (:func:`register_model`, ``torchvision:NAME``) may have it: its running statistics travel with the weights
or stay with each client (config ``buffers``). Convolutional models add padding only when an input is too small
for the paper's layout (8x8 digits), so 28x28 and 32x32 inputs get the published layer sizes exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from rayfl.user_input import UserError


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
    """McMahan et al., 2017, §3 CNN, the one FedFomo uses (Zhang et al., 2021, §4): conv5x5 32, pool, conv5x5 64,
    pool, FC 512, out; 'same' padding as in TensorFlow, ~1.66M parameters on MNIST."""
    def features(c, pad):
        return [nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]

    return _conv_net("mcmahan-cnn", input_shape, features, (2,),
                     lambda flat: [nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, num_outputs)])


def tf_cnn(input_shape: tuple, num_outputs: int) -> nn.Module:
    """FedFomo's default `--arch tf_cnn` in the authors' code: conv3x3 32, pool, conv3x3 64, pool, conv3x3 64,
    FC 64, out; unpadded (1024 features on 32x32, 576 on 28x28), padded by 1 for 8x8 inputs."""
    def features(c, pad):
        return [nn.Conv2d(c, 32, 3, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(64, 64, 3, padding=pad), nn.ReLU()]

    return _conv_net("tf-cnn", input_shape, features, (0, 1),
                     lambda flat: [nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_outputs)])


def lenet5(input_shape: tuple, num_outputs: int) -> nn.Module:
    """LeNet-5 as in FedMoE (Listo Zec et al., 2020, §4) and user-centric FL (Mestoukirdi et al., 2021, §IV-A):
    conv5x5 6, pool, conv5x5 16, pool, FC 120, FC 84, out; unpadded (400 features on 32x32, 256 on 28x28),
    padded by 2 for 8x8 inputs. The dropout after fc1 in FedMoE's code is left out."""
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
    """FedeRiCo's sine toy (Sui et al., 2022, §1, Fig. 1): each client fits a LINEAR model h(x) = a*x + b to
    its interval of the curve, so this is one Linear layer; the personalization, not the model, is meant to bend the fit."""
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


BUILTIN = tuple(MODELS)
TORCHVISION = "torchvision:"  # `model=torchvision:resnet18`: torchvision's classification models, untrained


@dataclass(frozen=True)
class ModelSource:
    """A user's model, declared: what a plugin module exports as ``MODEL`` and :func:`register_model` keeps.
    ``factory(input_shape, num_outputs)`` returns an ``nn.Module`` mapping (N, *input_shape) to (N, num_outputs),
    as the built-in models do."""

    name: str
    factory: Callable[[tuple, int], nn.Module]


def register_model(model, factory: Callable[[tuple, int], nn.Module] | None = None) -> ModelSource:
    """Make a model known by name (``model=NAME``): ``register_model(name, factory)``, or ``register_model(obj)``
    with a :class:`ModelSource` (or any object with ``name`` and ``factory``). Registering a name again replaces
    it. The factory travels to the client actors with the run (pickled by Ray: define it in a module the actors
    can import, or in the script itself)."""
    if factory is None and not isinstance(model, str):
        if not (hasattr(model, "name") and hasattr(model, "factory")):
            raise UserError(f"register_model({model!r}): give a name and a factory, or a ModelSource")
        model, factory = model.name, model.factory
    if not isinstance(model, str) or not model.strip() or ":" in model or "\0" in model or model == "auto":
        raise UserError(f"model name {model!r}: must be a non-empty name without ':'")
    if model in BUILTIN:
        raise UserError(f"model={model!r}: a built-in model; register yours under another name")
    if not callable(factory):
        raise UserError(f"model={model!r}: factory {factory!r} is not callable; give factory(input_shape, "
                        f"num_outputs) -> nn.Module")
    MODELS[model] = factory
    return ModelSource(model, factory)


def registered() -> dict[str, Callable]:
    """The registered (not built-in) models: name -> factory."""
    return {k: v for k, v in MODELS.items() if k not in BUILTIN}


def restore(factories: dict | None) -> None:
    """Register in this process what :func:`registered` gave in another."""
    for name, factory in (factories or {}).items():
        MODELS.setdefault(name, factory)


def check_model_name(name: str) -> None:
    """``auto``, a built-in or registered model, or ``torchvision:NAME`` of a torchvision classification model."""
    if name == "auto" or name in MODELS:
        return
    if str(name).startswith(TORCHVISION):
        arch = name[len(TORCHVISION):]
        allowed = _torchvision_names()
        if arch not in allowed:
            import difflib

            close = difflib.get_close_matches(arch, allowed, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(TORCHVISION + c for c in close)}?)" if close else ""
            raise UserError(f"model={name!r}: torchvision has no classification model {arch!r}{hint}; allowed: "
                            f"the names torchvision.models.list_models() gives, e.g. torchvision:resnet18")
        return
    raise UserError(f"model={name!r}: unknown; allowed: auto, {', '.join(MODELS)}, torchvision:NAME (e.g. "
                    f"torchvision:resnet18) or a name given to rayfl.register_model")


def _torchvision_names() -> list[str]:
    import torchvision.models as tvm

    return sorted(tvm.list_models(module=tvm))


def torchvision_model(arch: str, input_shape: tuple, num_outputs: int) -> nn.Module:
    """torchvision's ``arch``, untrained (weights=None: nothing is downloaded), with ``num_outputs`` classes and
    its first convolution rebuilt for the dataset's channels when they are not 3. Images keep their size:
    nothing is resized, so a network whose downsampling outruns small images (AlexNet, VGG, Inception on 8x8)
    fails the dummy forward pass at the door; ResNets and others that end in adaptive pooling take 8x8 up."""
    import torchvision.models as tvm

    c = _image(TORCHVISION + arch, input_shape)[0]
    kwargs = {"aux_logits": False, "init_weights": True} if arch in ("googlenet", "inception_v3") else {}
    model = tvm.get_model(arch, weights=None, num_classes=int(num_outputs), **kwargs)
    if c != 3:
        for parent in model.modules():
            for child_name, child in parent.named_children():
                if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                    setattr(parent, child_name, nn.Conv2d(c, child.out_channels, child.kernel_size, child.stride,
                                                          child.padding, child.dilation, child.groups,
                                                          child.bias is not None, child.padding_mode))
                    return model
    return model


def build_model(name: str, input_shape: tuple, num_outputs: int, factory: Callable | None = None) -> nn.Module:
    """The network ``name`` for inputs of ``input_shape``; ``factory``, where given, builds it (a registered
    model's, carried to processes where it was not registered)."""
    if factory is not None:
        return factory(tuple(input_shape), int(num_outputs))
    if name.startswith(TORCHVISION):
        return torchvision_model(name[len(TORCHVISION):], tuple(input_shape), int(num_outputs))
    if name not in MODELS:
        raise UserError(f"model={name!r}: unknown; allowed: {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), int(num_outputs))


def check_model(name: str, model, input_shape: tuple, num_outputs: int, dataset: str) -> None:
    """A model the run can train, checked once on the CPU before any actor starts: an ``nn.Module`` whose output
    for a dummy batch of two is (2, num_outputs), and no BatchNorm with momentum=None (a cumulative average
    needs a per-client batch count, which rayfl does not keep: only float buffers travel or stay with a client)."""
    if not isinstance(model, nn.Module):
        raise UserError(f"model={name!r}: its factory returned a {type(model).__name__}, not a torch nn.Module")
    for layer, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats \
                and module.momentum is None:
            raise UserError(f"model={name!r}: layer {layer!r} ({type(module).__name__}) has momentum=None (a "
                            f"cumulative average); give it a momentum (0.1 is torch's default)")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as e:  # noqa: BLE001 - the user's network, whatever it raises: one line
        raise UserError(f"model={name!r} does not fit dataset {dataset!r} of shape {tuple(input_shape)}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_outputs):
        got = tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"model={name!r}: gives outputs of shape {got} per sample; dataset {dataset!r} needs "
                        f"{num_outputs} ({'classes' if num_outputs > 1 else 'output'})")


def default_model(ds) -> str:
    """The model for cfg.model == "auto": the one the papers pair with the dataset."""
    if ds.name in _DEFAULTS:
        return _DEFAULTS[ds.name]
    return "mlp-small" if len(ds.input_shape) == 1 else "lenet5"
