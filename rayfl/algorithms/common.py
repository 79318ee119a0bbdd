"""What two or more algorithms share, in one place: each algorithm module keeps its paper's own math and imports
these. Importing this module imports no torch (a driver running FedAvg never needs it); the helpers that train
import it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from rayfl.algorithms.base import ClientLogic
from rayfl.reduce import WeightedMean

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_SPLIT = 2  # layers on the model's side of the split by default (FedPer's K_P, LG-FedAvg's global head)


# ------------------------------------------------------------------------------------------- summaries

def weighted_mean(ups: dict, key: str, weight: str = "n") -> float:
    """Size-weighted mean of one scalar across uploads (NaN-free uploads only)."""
    pairs = [(u[key], u[weight]) for u in ups.values() if u.get(weight, 0) > 0 and u[key] == u[key]]
    return float(np.average([p[0] for p in pairs], weights=[p[1] for p in pairs])) if pairs else float("nan")


def with_global_model(record: dict, client, vec) -> dict:
    """An evaluation record with the global model's test loss and accuracy beside the personalized model's, as the
    split ``global_model`` (summarized as ``global_model_acc_mean``, ...): the papers' global-model column."""
    glob = client.evaluate(client.model_of(vec), ("test",))
    return {**record, "global_model_loss": glob["test_loss"], "global_model_acc": glob["test_acc"],
            "n_global_model": glob["n_test"]}


# ------------------------------------------------------------------------------------------- averaging

# w_{k+1} = (1/|A_k|) Σ_{i∈A_k} w^i (Per-FedAvg's server line, Fallah et al. 2020, Algorithm 1; pFedMe's too): the engine's weighted mean with every upload
# carrying weight "one" = 1, summed inside the client actors
UNIFORM = WeightedMean("weights", by="one")


# ------------------------------------------------------------------------------------------- plain gradient steps
# (Per-FedAvg, Fallah et al. 2020; pFedMe, Dinh et al. 2020)

def plain_steps(cfg, why: str) -> None:
    """Refuse run settings an algorithm with its own plain gradient steps would silently ignore."""
    if cfg.optimizer != "sgd":
        raise ValueError(f"optimizer={cfg.optimizer!r}: {why}; use optimizer=sgd")
    if cfg.momentum != 0:
        raise ValueError(f"momentum={cfg.momentum}: {why}; use momentum=0")
    if cfg.weight_decay != 0:
        raise ValueError(f"weight_decay={cfg.weight_decay}: {why}; use weight_decay=0")


def flat_gradient(model: nn.Module, loss: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """∂loss/∂v for v the model's weight vector (rayfl.training.to_vector's order); 0 for buffers, frozen and
    unused parameters. ``keep=False``: a flattened model's own gradient buffer, valid until its next gradient
    (for a caller that uses it at once)."""
    import torch
    from torch import nn

    from rayfl import training

    if training.flat_weights(model) is not None:  # a flattened model: backward into its flat buffer
        grad = training.flat_grad(model)  # zeroed; every trainable parameter's .grad is a view of it
        loss.backward()
        return grad.clone() if keep else grad  # the buffer is reused by the next call
    entries = [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]
    params = [t for t in entries if isinstance(t, nn.Parameter) and t.requires_grad]
    grads = dict(zip(map(id, params), torch.autograd.grad(loss, params, allow_unused=True)))
    return torch.cat([(g if g is not None else torch.zeros_like(t)).reshape(-1)
                      for t, g in ((t, grads.get(id(t))) for t in entries)]).detach()


def gradient(model: nn.Module, vec: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             loss_fn: Callable, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """f(vec; (x, y)) and ∇f(vec; (x, y)), the stochastic gradient of Algorithm 1, as a flat vector (``keep``:
    :func:`flat_gradient`'s). ``vec`` may be the model's own flat weights (nothing to load then)."""
    from rayfl import training

    training.load_vector(model, vec)
    training.set_mode(model, training=True)
    loss = loss_fn(model(x), y)
    return loss.detach(), flat_gradient(model, loss, keep)


class Batches:
    """A client's training split as a stream of minibatches: consecutive slices of random permutations drawn
    with ``gen``, a new permutation when one is used up; consecutive batches are disjoint within a pass."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, gen: torch.Generator):
        self.x, self.y, self.batch_size, self.gen = x, y, batch_size, gen
        self.order: torch.Tensor | None = None  # the current permutation (None: none drawn yet)
        self.start: int | None = None  # where the next batch starts in it

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        n = self.x.shape[0]
        if self.order is None or self.start >= n:
            self.order = torch.randperm(n, generator=self.gen).to(self.x.device)
            self.start = 0
        idx = self.order[self.start:self.start + self.batch_size]
        self.start += self.batch_size
        return self.x[idx], self.y[idx]


def batches_per_epoch(n: int, batch_size: int) -> int:
    return -(-n // batch_size)


def to_tensor(vec, device) -> torch.Tensor:
    """A writable float32 copy of a weight vector (object-store arrays are read-only)."""
    import torch

    return torch.from_numpy(np.array(vec, dtype=np.float32)).to(device)


# ------------------------------------------------------------------------------------------- a split model
# (FedPer, Arivazhagan et al. 2019; LG-FedAvg, Liang et al. 2020)

def check_layers(name: str, value) -> None:
    """A layer count: an integer >= 0 (0: the model's default)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r}: must be an integer >= 0 (0: the model's default)")


def check_split(name: str, value: int, model_name: str, model, algo: str, parts: str) -> None:
    """The run's model must have a layer on each side of the split: ``value`` in [1, L-1] (or 0, the default)."""
    from rayfl.algorithms.layers import layer_slices

    n = len(layer_slices(model))
    if n < 2:
        raise ValueError(f"model={model_name!r}: has {n} layer; {algo} needs at least 2 ({parts})")
    if value > n - 1:
        raise ValueError(f"{name}={value}: model {model_name!r} has {n} layers, so at most {n - 1} (one is left "
                         f"to the other side of the split)")


def split_size(k: int, n_layers: int) -> int:
    """The number of layers on the model's side of the split: k, or for k = 0 the default min(2, L - 1)."""
    return k if k else min(DEFAULT_SPLIT, n_layers - 1)


def shared_ranges(mask: np.ndarray) -> list[slice]:
    """A mask's True entries as contiguous ranges (one range for FedPer's base and for LG-FedAvg's head), so that
    taking the shared part copies those entries and nothing else."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], np.asarray(mask, bool), [False]]).astype(np.int8)))
    return [slice(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def with_shared(own, received, shared: list[slice]):
    """A client's model on receiving the global vector, written into ``own`` (its working copy, numpy or torch
    as ``received``): the shared entries (``shared``, ranges) from ``received``, the others its own (FedPer's
    client receiving W_B, LG-FedAvg's device receiving θ^g)."""
    for s in shared:
        own[s] = received[s]
    return own


class SplitClient(ClientLogic):
    """FedAvg's client with a mask: only the ``shared_mask`` entries of the global model replace the client's
    own, the whole model trains, the whole vector is uploaded (the server averages it; the personal entries of
    the average are never read). The client is evaluated on its own model under the current shared part. It is
    written before FedAvg's client in a logic's bases (``class FedPerClient(SplitClient, FedAvgClient)``), so that
    its steps stand over FedAvg's and FedAvg's own (``local_fit``, ``eval_weights``) stay under them."""

    def __init__(self, params):
        super().__init__(params)
        self.shared: list[slice] | None = None  # the shared entries' ranges; made once per host from its model

    def shared_mask(self, model) -> np.ndarray:
        """True on the entries the server's average overwrites (each algorithm says which)."""
        raise NotImplementedError

    def ranges(self, client) -> list[slice]:
        if self.shared is None:
            self.shared = shared_ranges(self.shared_mask(client.model))
        return self.shared

    def take_shared(self, client, model, received):
        """``model`` (holding the client's own weights) with the received shared part written in, in place."""
        from rayfl import training

        flat = training.flat_weights(model)
        if flat is None:  # a module that flatten left alone (tied weights): through a vector
            return client.load(with_shared(client.vector(model), received, self.ranges(client)), model)
        with_shared(flat.data, training.as_tensor(received), self.ranges(client))
        return model

    def step_train(self, client, msg, models):
        """Receive the shared part, train the whole model locally, upload it (the client and server algorithms'
        client side)."""
        model = self.take_shared(client, client.model, models["global"])
        result = client.fit(model)
        return {"weights": client.vector(model), **result}

    def step_evaluate(self, client, msg, models):
        """The personalized model: the client's own entries under the current global shared part, in a working
        copy (evaluation leaves the client as it was)."""
        return client.evaluate(self.take_shared(client, client.scratch(client.personal()), models["global"]))
