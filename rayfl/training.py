"""Training primitives every algorithm uses: flat weight vectors, minibatch epochs, evaluation.

Models travel as one flat float32 vector (cheap to put in Ray's object store, zero-copy to read,
one line to average); data stays as tensors on the client's device and is batched by index, with no
DataLoader, so that small clients are not dominated by loader overhead.
"""

from __future__ import annotations

import contextvars
import warnings
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _float_state(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point parameters and buffers, in state_dict order: what a weight vector holds."""
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


def flatten(model: nn.Module) -> nn.Module:
    """Re-point every floating parameter and buffer of ``model`` into one contiguous tensor, in place.

    Loading a weight vector is then one copy and reading one is one copy (``load_vector``/``to_vector``
    take a fast path): what lets a host keep one resident model and swap its clients' weights in and out,
    as pfl-research does. Models with tied weights keep the general path."""
    tensors = _float_state(model)
    if len({id(t) for t in tensors}) != len(tensors) or not tensors:
        return model
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.data = flat[offset:offset + n].view_as(t)
            offset += n
    model._rayfl_flat = flat
    return model


def to_vector(model: nn.Module) -> np.ndarray:
    """All floating-point state (parameters and buffers) as one float32 numpy vector (a copy)."""
    flat = getattr(model, "_rayfl_flat", None)
    with torch.no_grad():
        if flat is not None and flat.dtype == torch.float32:
            return flat.detach().cpu().numpy().copy()
        parts = [t.detach().reshape(-1).float() for t in _float_state(model)]
        return torch.cat(parts).cpu().numpy()


def as_tensor(vec) -> torch.Tensor:
    """A numpy or torch vector as a tensor, without a copy where none is needed: for reading only (an array
    from Ray's object store is read-only and shares its memory)."""
    if isinstance(vec, torch.Tensor):
        return vec
    with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(np.asarray(vec))


def load_vector(model: nn.Module, vec) -> nn.Module:
    """Copy a flat vector made by :func:`to_vector` (numpy or torch) into the model, in place."""
    src = as_tensor(vec)
    flat = getattr(model, "_rayfl_flat", None)
    if flat is not None:
        if src is flat:  # the model's own weights: already there
            return model
        if flat.numel() != src.numel():
            raise ValueError(f"weight vector has {src.numel()} values, model needs {flat.numel()}")
        with torch.no_grad():
            flat.copy_(src.reshape(-1))
        return model
    tensors = _float_state(model)
    needed = sum(t.numel() for t in tensors)
    if needed != src.numel():
        raise ValueError(f"weight vector has {src.numel()} values, model needs {needed}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(src[offset:offset + n].view_as(t))
            offset += n
    return model


class FlatSGD:
    """SGD (momentum, weight decay; torch.optim.SGD's update rule, dampening 0, not Nesterov) on a model made
    by :func:`flatten`: the gradients live in one flat buffer too, so a step is one fused update instead of
    torch.optim's per-tensor Python work (which, for the small client models of a simulation, costs as much
    as the arithmetic), and no torch.optim machinery is imported at start-up."""

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.flat = model._rayfl_flat
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buf: torch.Tensor | None = None
        self.grad = flat_grad(model)
        # weight decay is for trainable parameters only: not BatchNorm's running statistics, which share
        # the flat vector (None: every position is a trainable parameter, the common case)
        self.decays = trainable_mask(model) if weight_decay and len(buffer_index(model)) else None

    def zero_grad(self, set_to_none: bool = True) -> None:  # the flat buffer stays; it is zeroed in place
        self.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        g = self.grad
        if self.weight_decay:
            g = g.add(self.flat if self.decays is None else self.flat * self.decays, alpha=self.weight_decay)
        if self.momentum:
            if self.buf is None:
                self.buf = g.clone()
            else:
                self.buf.mul_(self.momentum).add_(g)
            g = self.buf
        self.flat.add_(g, alpha=-self.lr)


def buffer_index(model: nn.Module) -> torch.Tensor:
    """Positions in the model's weight vector that hold buffers or frozen tensors, not trainable parameters
    (BatchNorm's running mean and variance); empty for most models. Kept by the module."""
    index = model.__dict__.get("_rayfl_buffers")
    if index is None:
        positions, offset = [], 0
        for t in _float_state(model):
            n = t.numel()
            if not (isinstance(t, nn.Parameter) and t.requires_grad):
                positions.append(torch.arange(offset, offset + n))
            offset += n
        index = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        model.__dict__["_rayfl_buffers"] = index
    return index


def trainable_mask(model: nn.Module) -> torch.Tensor:
    """1 where the weight vector holds a trainable parameter, 0 at :func:`buffer_index`'s positions."""
    flat = model._rayfl_flat
    mask = torch.ones_like(flat)
    mask[buffer_index(model).to(flat.device)] = 0
    return mask


def flat_weights(model: nn.Module) -> torch.Tensor | None:
    """A flattened model's weight vector, the tensor its parameters are views of (updated in place, it is the
    model's weights); None for a model that is not flat."""
    return getattr(model, "_rayfl_flat", None)


def flat_grad(model: nn.Module) -> torch.Tensor:
    """The model's flat gradient buffer, zeroed, every parameter's ``.grad`` a view of it; made once per
    module (a host's resident and spare modules train client after client)."""
    grad = getattr(model, "_rayfl_grad", None)
    if grad is not None and all(p.grad is not None and p.grad._base is grad
                                for p in model.parameters() if p.requires_grad and p.is_floating_point()):
        return grad.zero_()  # still linked (nothing set the grads to None or to other tensors since)
    grad = torch.zeros_like(model._rayfl_flat)
    offset = 0
    for t in _float_state(model):
        n = t.numel()
        if isinstance(t, nn.Parameter) and t.requires_grad:
            t.grad = grad[offset:offset + n].view_as(t)  # backward accumulates into the flat buffer
        offset += n
    model._rayfl_grad = grad
    return grad


def optimizer_for(model: nn.Module, name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """The optimizer a client trains ``model`` with: :class:`FlatSGD` where the model is flat and the
    optimizer plain SGD, else torch's."""
    if name == "sgd" and getattr(model, "_rayfl_flat", None) is not None:
        return FlatSGD(model, lr, momentum, weight_decay)
    return make_optimizer(model.parameters(), name, lr, momentum, weight_decay)


def loss_fn_for(task: str) -> Callable:
    return F.mse_loss if task == "regression" else F.cross_entropy


def make_optimizer(params, name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def set_mode(model: nn.Module, training: bool) -> None:
    """``model.train(training)`` when the model is not in that mode already: the call walks every submodule,
    which at 1,000 tiny evaluations a round cost an eighth of the round."""
    if model.training != training or any(m.training != training for m in model.children()):
        model.train(training)


# The trainer that replaces plain minibatch SGD while a client step's training must be private: rayfl.privacy
# sets it around such a step (DP-SGD, charged to the client's account), so that every caller of train_epochs
# (client.fit, PersFL's distillation, FedMoE's specialist and gate) takes the private path without knowing of it.
PRIVATE_TRAINER: contextvars.ContextVar = contextvars.ContextVar("rayfl_private_trainer", default=None)


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int,
                 optimizer: torch.optim.Optimizer, loss_fn: Callable, gen: torch.Generator) -> float:
    """Minibatch SGD over (x, y) for some epochs; returns the mean training loss of the last epoch. Inside a
    client step whose training must be private (sample-level DP), DP-SGD instead (:data:`PRIVATE_TRAINER`),
    which draws its batches and noise from a generator of the release's own, not from ``gen``."""
    private = PRIVATE_TRAINER.get()
    if private is not None:
        return private(model, x, y, epochs, batch_size, optimizer, loss_fn, gen)
    set_mode(model, training=True)
    n = x.shape[0]
    total = None
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device)  # summed on the device: no sync per batch
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += loss.detach() * idx.numel()
    return float(total) / n if total is not None and n else float("nan")


PASS_BYTES = 8 << 20  # on a CPU, an evaluation pass's largest activation is kept within this (see pass_size)
_LARGEST: dict[tuple, int] = {}  # (model type, parameter shapes, sample shape) -> largest activation per sample


def pass_size(model: nn.Module, x: torch.Tensor, limit: int) -> int:
    """Samples per evaluation forward pass of ``model`` on inputs like ``x``: at most ``limit``, and on a CPU
    no more than keep the pass's largest activation (input included) within PASS_BYTES. A pass whose
    activations outgrow the last-level cache costs up to twice as much per sample: on the 32 MiB L3 of the
    machine rayfl is benchmarked on, LeNet-5 took 25 us a sample in passes of 128 and 51 in passes of 2,048,
    McMahan's CNN 283 and 506 (``benchmarks/eval_pass.py``), while an MLP's cost stays flat. On a GPU large
    passes pay: ``limit`` there."""
    if x.device.type != "cpu" or not isinstance(model, nn.Module):
        return limit
    return max(1, min(limit, PASS_BYTES // (4 * _largest(model, tuple(x.shape[1:]), x.dtype))))


def _largest(model: nn.Module, shape: tuple, dtype) -> int:
    """largest_activation for samples of ``shape``, kept by the module (a host asks once per client) and by
    architecture (FedeRiCo builds a mixture per client)."""
    known = model.__dict__.setdefault("_rayfl_largest", {})
    if shape not in known:
        key = (type(model), tuple(tuple(p.shape) for p in model.parameters()), shape)
        if key not in _LARGEST:
            _LARGEST[key] = largest_activation(model, torch.zeros((1, *shape), dtype=dtype))
        known[shape] = _LARGEST[key]
    return known[shape]


@torch.no_grad()
def largest_activation(model: nn.Module, sample: torch.Tensor) -> int:
    """Elements per sample of the largest tensor a forward pass of ``sample`` (one sample) makes: its input or
    any module's output."""
    sizes = [sample[0].numel()]

    def seen(module, inputs, out):
        if torch.is_tensor(out):
            sizes.append(out[0].numel() if out.dim() else 1)

    hooks = [m.register_forward_hook(seen) for m in model.modules()]
    modes = {m: m.training for m in model.modules()}
    model.eval()  # in training mode BatchNorm would fold this one sample into its running statistics
    try:
        model(sample)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return max(sizes)


@torch.no_grad()
def evaluate_small(model: nn.Module, x: torch.Tensor, y: torch.Tensor, sizes: list[int], task: str) -> list[tuple]:
    """:func:`evaluate` of consecutive segments of (x, y) (``sizes`` samples each) in one forward pass: for
    clients whose splits are small, where each forward's fixed cost, not the arithmetic, is the price."""
    set_mode(model, training=False)
    out = model(x)
    losses = loss_fn_for(task)(out, y, reduction="none")
    per_sample = losses.reshape(losses.shape[0], -1).sum(1).double().cpu().numpy()
    sizes = np.asarray(sizes, dtype=np.int64)
    filled = sizes > 0  # np.add.reduceat would give an empty segment its next sample, not 0
    starts = (np.cumsum(sizes) - sizes)[filled]
    loss = np.full(len(sizes), np.nan)
    acc = np.full(len(sizes), np.nan)
    if starts.size:  # each segment summed on its own: a client's record does not depend on its neighbours
        values = y[0].numel() if task == "regression" else 1  # regression: a loss per value
        loss[filled] = np.add.reduceat(per_sample, starts) / (sizes[filled] * values)
        if task != "regression":
            hits = (out.argmax(1) == y).cpu().numpy().astype(np.int64)
            acc[filled] = np.add.reduceat(hits, starts) / sizes[filled]
    return list(zip(loss.tolist(), acc.tolist()))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str, batch_size: int | None = None) -> tuple:
    """(mean loss, accuracy) on (x, y), in passes of ``batch_size`` (default :func:`pass_size`, at most 1,024);
    accuracy is NaN for regression and for an empty split."""
    n = x.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    set_mode(model, training=False)
    batch_size = batch_size or pass_size(model, x, 1024)
    loss_fn = loss_fn_for(task)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, n, batch_size):
        out = model(x[start:start + batch_size])
        yb = y[start:start + batch_size]
        total += loss_fn(out, yb, reduction="sum")
        if task != "regression":
            correct += (out.argmax(1) == yb).sum()
    total = float(total)
    per = total / n if task != "regression" else total / (n * y[0].numel())
    return per, (int(correct) / n if task != "regression" else float("nan"))
