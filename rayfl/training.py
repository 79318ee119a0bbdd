"""Training primitives every algorithm uses: flat weight vectors, minibatch epochs, evaluation.

Models travel as one flat float32 vector (cheap to put in Ray's object store, zero-copy to read,
one line to average); data stays as tensors on the client's device and is batched by index, with no
DataLoader, so that small clients are not dominated by loader overhead.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def to_vector(model: nn.Module) -> np.ndarray:
    """All floating-point state (parameters and buffers) as one float32 numpy vector."""
    with torch.no_grad():
        parts = [t.detach().reshape(-1).float() for t in model.state_dict().values() if t.is_floating_point()]
        return torch.cat(parts).cpu().numpy()


def load_vector(model: nn.Module, vec: np.ndarray) -> nn.Module:
    """Copy a flat vector made by :func:`to_vector` into the model, in place."""
    with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        src = torch.as_tensor(np.asarray(vec))
    needed = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    if needed != src.numel():
        raise ValueError(f"weight vector has {src.numel()} values, model needs {needed}")
    offset = 0
    with torch.no_grad():
        for t in model.state_dict().values():
            if not t.is_floating_point():
                continue
            n = t.numel()
            t.copy_(src[offset:offset + n].view_as(t))
            offset += n
    return model


def weighted_average(vectors: list[np.ndarray], weights) -> np.ndarray:
    """Σ_k w_k v_k / Σ_k w_k, in float64 accumulation to keep 100-client sums exact enough."""
    w = np.asarray(weights, dtype=np.float64)
    if len(vectors) == 0 or w.sum() <= 0:
        raise ValueError("weighted_average needs at least one vector with positive weight")
    out = np.zeros(vectors[0].shape, dtype=np.float64)
    for v, wk in zip(vectors, w):
        out += wk * v
    return (out / w.sum()).astype(np.float32)


def loss_fn_for(task: str) -> Callable:
    return F.mse_loss if task == "regression" else F.cross_entropy


def make_optimizer(params, name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int,
                 optimizer: torch.optim.Optimizer, loss_fn: Callable, gen: torch.Generator) -> float:
    """Minibatch SGD over (x, y) for some epochs; returns the mean training loss of the last epoch."""
    model.train()
    n = x.shape[0]
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        total, seen = 0.0, 0
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * idx.numel()
            seen += idx.numel()
        last = total / max(seen, 1)
    return last


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str, batch_size: int = 1024) -> tuple:
    """(mean loss, accuracy) on (x, y); accuracy is NaN for regression and for an empty split."""
    n = x.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    model.eval()
    loss_fn = loss_fn_for(task)
    total, correct = 0.0, 0
    for start in range(0, n, batch_size):
        out = model(x[start:start + batch_size])
        yb = y[start:start + batch_size]
        total += loss_fn(out, yb, reduction="sum").item()
        if task != "regression":
            correct += (out.argmax(1) == yb).sum().item()
    per = total / n if task != "regression" else total / (n * y[0].numel())
    return per, (correct / n if task != "regression" else float("nan"))
