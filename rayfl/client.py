"""A client: its data splits, its weights, its personal state, and the local-training settings.

A Client lives for the whole experiment inside one host (a Ray actor, or the test process), so that
nothing personal is shipped back and forth between rounds. Algorithms reach everything they need
through it: ``fit`` and ``evaluate`` for the common work, ``state`` for their own.

A client costs little until it has weights of its own: its personal weights are one flat tensor, made on
first use (until then it holds the common initial model), and ``client.model`` is the host's one resident
module with this client's weights swapped in (see :class:`Bench`). So 10,000 clients fit in one process,
and an algorithm without a personal model (FedAvg) keeps none.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from rayfl import training


@dataclass(frozen=True)
class TrainSettings:
    """The local-training part of the config, as a client needs it."""

    task: str
    local_epochs: int
    lr: float
    batch_size: int
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    dp: Any = None  # rayfl.privacy.DPSettings when the run is differentially private
    buffers: str = "global"  # config `buffers`: "local" keeps each client's own BatchNorm statistics

    @classmethod
    def from_config(cls, cfg, task: str) -> "TrainSettings":
        from rayfl.privacy import DPSettings

        return cls(task, cfg.local_epochs, cfg.lr, cfg.batch_size, cfg.optimizer, cfg.momentum,
                   cfg.weight_decay, DPSettings.from_config(cfg), cfg.buffers)


class Bench:
    """A host's resident modules: ``resident`` carries whichever client's personal weights are checked out
    (copied in on first use, copied back when another client takes it or the host call ends), ``spare`` is a
    working model any step may load a vector into (FedAvg's training copy), and ``loaded`` keeps the models
    that received vectors (peers' models, candidates) loaded for the rest of one host call, so that a vector
    routed to several clients of a host is loaded once (FedeRiCo's mixtures, FedFomo's candidates). Those
    modules are kept for the next call (``free``): building a module costs more than loading a vector."""

    MAX_LOADED = 64  # models kept loaded within a call (a step may use more at once: then there are more)

    def __init__(self, make_model: Callable[[], nn.Module], initial: np.ndarray | None, device: str = "cpu"):
        self.make_model, self.device = make_model, device
        self.loaded: dict[int, tuple] = {}  # id(vector) -> (vector, module, step that last used it)
        self.free: list[nn.Module] = []  # modules loaded in an earlier call, ready for another vector
        self.step = 0  # advanced by the host before each client's step
        self.resident = self.fresh()
        self.buffer_index = training.buffer_index(self.resident).to(device)  # BatchNorm statistics' positions
        if initial is None:  # no common initial model: a freshly initialised one
            initial = training.to_vector(self.resident)
        self.initial = torch.tensor(np.asarray(initial, dtype=np.float32), device=device)  # a copy: Ray's is read-only
        self.spare = self.fresh()
        self.owner: "Client | None" = None

    def fresh(self, vec=None) -> nn.Module:
        module = training.flatten(self.make_model().to(self.device))
        return module if vec is None else training.load_vector(module, vec)

    def checkout(self, client: "Client") -> nn.Module:
        if self.owner is not client:
            self.release()
            training.load_vector(self.resident, client._weights if client._weights is not None else self.initial)
            self.owner = client
        return self.resident

    def model_of(self, vec) -> nn.Module:
        """A model holding ``vec`` (read only), shared by this host's clients until the call ends."""
        key = id(vec)
        hit = self.loaded.pop(key, None)
        if hit is not None and hit[0] is vec:  # the entry holds vec, so its id cannot have been reused
            self.loaded[key] = (vec, hit[1], self.step)
            return hit[1]
        module = None
        if len(self.loaded) >= self.MAX_LOADED:  # reuse the oldest model not used by the current step
            old = next((k for k, (_, _, step) in self.loaded.items() if step != self.step), None)
            if old is not None:
                module = self.loaded.pop(old)[1]
        if module is None:
            module = self.free.pop() if self.free else self.fresh()
        training.load_vector(module, vec)
        self.loaded[key] = (vec, module, self.step)
        return module

    def end_call(self) -> None:
        """The host call is over: weights go home, loaded vectors are let go (their modules kept)."""
        self.release()
        self.free.extend(module for _, module, _ in self.loaded.values())
        self.loaded.clear()

    def release(self) -> None:
        """Copy the checked-out client's weights home; the resident module is free again."""
        owner, self.owner = self.owner, None
        if owner is not None:
            flat = self.resident._rayfl_flat if hasattr(self.resident, "_rayfl_flat") else None
            vec = flat if flat is not None else torch.as_tensor(training.to_vector(self.resident), device=self.device)
            if owner._weights is None:
                owner._weights = vec.detach().clone()
            else:
                owner._weights.copy_(vec)


class Client:
    def __init__(self, cid: int, splits: dict, make_model: Callable[[], nn.Module] | None,
                 initial: np.ndarray | None, settings: TrainSettings, seed: int, device: str = "cpu",
                 share: Callable[[Any], Any] = lambda v: v, group: int | None = None, bench: Bench | None = None):
        """``bench``: the host's shared resident modules; a client made on its own gets a bench of its own
        from ``make_model`` and ``initial``."""
        self.cid = cid
        self.splits = splits  # {"train": (x, y), "val": (x, y), "test": (x, y)} tensors on device
        self.device = device
        self.settings = settings
        self.group = group
        self.share = share  # wraps a vector so that it travels as a handle (ray.put under Ray)
        self._bench = bench if bench is not None else Bench(make_model, initial, device)
        self._weights: torch.Tensor | None = None  # personal weights, flat; None: still the initial model
        self._buffers: torch.Tensor | None = None  # buffers=local: its own buffers; None: the initial model's
        self.state: dict[str, Any] = {}  # the algorithm's personal state (teacher, row of P, ...)
        self.seed = seed  # with cid, what keys its private releases (rayfl.privacy)
        self.rng = np.random.default_rng([seed, cid])
        self.gen = torch.Generator().manual_seed(int(self.rng.integers(2**62)))
        self.optimizer = None  # an algorithm that keeps optimizer state across rounds sets it

    # --- sizes -----------------------------------------------------------------------------------
    def n(self, split: str = "train") -> int:
        return int(self.splits[split][0].shape[0])

    # --- models ----------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """This client's personal model (the host's resident module, with this client's weights in it)."""
        initial = self._weights is None and self._bench.owner is not self
        model = self._bench.checkout(self)
        return self._own_buffers(model) if initial else model

    @model.setter
    def model(self, module: nn.Module) -> None:
        training.load_vector(self.model, training.to_vector(module))

    @property
    def initial(self) -> torch.Tensor:
        """The common initial model's weight vector, flat, on the client's device (read only)."""
        return self._bench.initial

    def weights(self) -> np.ndarray | None:
        """The personal weights as a numpy copy, or None while the client has none (snapshots, artifacts)."""
        if self._bench.owner is self:
            self._bench.release()
        return None if self._weights is None else self._weights.cpu().numpy().copy()

    def personal(self) -> torch.Tensor:
        """The personal weights, flat, without a copy (the common initial model's while it has none): read only,
        to load into a working copy (``scratch``)."""
        if self._bench.owner is self:
            self._bench.release()
        return self._weights if self._weights is not None else self._bench.initial

    def set_weights(self, vec: np.ndarray | None) -> None:
        """Replace the personal weights (None: back to the common initial model), as a restore does."""
        if self._bench.owner is self:
            self._bench.owner = None  # what the resident module held is superseded
        self._weights = None if vec is None else torch.tensor(np.array(vec), device=self.device)

    def new_model(self, vec: np.ndarray | None = None) -> nn.Module:
        """A fresh copy of the architecture on this client's device, loaded from ``vec`` if given."""
        return self._bench.fresh(vec) if vec is None else self._own_buffers(self._bench.fresh(vec))

    def scratch(self, vec) -> nn.Module:
        """The host's spare model loaded with ``vec``: no allocation, valid until the next ``scratch`` call.
        For a working copy that is not the client's own (FedAvg's local training, candidate losses)."""
        return self._own_buffers(training.load_vector(self._bench.spare, vec))

    def model_of(self, vec) -> nn.Module:
        """A model holding another party's vector (a peer's model, a candidate), read only: loaded once per
        host call however many of the host's clients use it."""
        return self._own_buffers(self._bench.model_of(vec))

    def load(self, vec: np.ndarray, model: nn.Module | None = None) -> nn.Module:
        return self._own_buffers(training.load_vector(model if model is not None else self.model, vec))

    # --- buffers -----------------------------------------------------------------------------------
    # With ``buffers=local`` (FedBN, Li et al. 2021, Alg. 1) a client's BatchNorm statistics are its own: every
    # vector it receives is loaded with its own statistics in place of the vector's, and what its training
    # leaves in them is kept for the next round. The weight vector keeps its layout (the uploads still carry
    # statistics, which an average mixes and no client loads). The integer num_batches_tracked is in no vector
    # and belongs to the host's shared module; BatchNorm reads it only with momentum=None, which is refused.
    def _local_buffers(self) -> bool:
        return self.settings.buffers == "local" and len(self._bench.buffer_index) > 0

    def _own_buffers(self, model: nn.Module) -> nn.Module:
        """``model`` with this client's buffers written in, under ``buffers=local``; as it was otherwise."""
        if not self._local_buffers():
            return model
        idx = self._bench.buffer_index
        own = self._buffers if self._buffers is not None else self._bench.initial[idx]
        flat = getattr(model, "_rayfl_flat", None)
        with torch.no_grad():
            if flat is not None and flat.numel() == self._bench.initial.numel():
                flat[idx] = own
            elif flat is None:  # a module that flatten left alone (tied weights)
                vec = torch.as_tensor(training.to_vector(model), device=self.device)
                if vec.numel() == self._bench.initial.numel():
                    vec[idx] = own
                    training.load_vector(model, vec)
        return model

    def _keep_buffers(self, model: nn.Module) -> None:
        """After this client trained ``model``: its buffers are the client's own from now on (buffers=local)."""
        if self._local_buffers():
            flat = getattr(model, "_rayfl_flat", None)
            vec = flat if flat is not None else torch.as_tensor(training.to_vector(model), device=self.device)
            if vec.numel() == self._bench.initial.numel():
                self._buffers = vec.detach()[self._bench.buffer_index].clone()

    def buffers(self) -> np.ndarray | None:
        """Its own buffers (buffers=local) as a numpy copy, or None while it has none (snapshots)."""
        return None if self._buffers is None else self._buffers.cpu().numpy().copy()

    def set_buffers(self, values: np.ndarray | None) -> None:
        self._buffers = None if values is None else torch.tensor(np.array(values), device=self.device)

    def vector(self, model: nn.Module | None = None) -> np.ndarray:
        return training.to_vector(model if model is not None else self.model)

    # --- work ------------------------------------------------------------------------------------
    def fit(self, model: nn.Module | None = None, epochs: int | None = None, lr: float | None = None,
            loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
            split: str = "train") -> dict:
        """Local training with the run's settings (each may be overridden); returns train_loss and n."""
        model = model if model is not None else self.model
        s = self.settings
        if optimizer is None:
            optimizer = training.optimizer_for(model, s.optimizer, lr or s.lr, s.momentum, s.weight_decay)
        x, y = self.splits[split]
        if x.shape[0] == 0:
            return {"train_loss": float("nan"), "n": 0}
        loss = training.train_epochs(model, x, y, epochs or s.local_epochs, s.batch_size, optimizer,
                                     loss_fn or training.loss_fn_for(s.task), self.gen)
        self._keep_buffers(model)
        return {"train_loss": loss, "n": int(x.shape[0])}

    def loss_of(self, vec: np.ndarray, split: str = "val") -> float:
        """Loss of a weight vector on a split (loaded once per host call, see ``model_of``): how FedFomo
        weighs downloads and PersFL checks teacher candidates."""
        return self.loss(self.model_of(vec), split)

    def loss(self, model: nn.Module, split: str = "val") -> float:
        x, y = self.splits[split]
        return training.evaluate(model, x, y, self.settings.task)[0]

    def evaluate(self, model: nn.Module | Callable, splits=("val", "test")) -> dict:
        """Loss and accuracy of ``model`` on each split, with split sizes: the loop's evaluation record."""
        if self.small_eval(eval_pass(model, self.splits[splits[0]][0]), splits):
            return evaluate_together(model, [self], splits)[0]
        results = [training.evaluate(model, *self.splits[split], self.settings.task) for split in splits]
        return _record(_names(splits), [self.n(split) for split in splits], results)

    def small_eval(self, limit: int, splits=("val", "test")) -> bool:
        """Whether ``evaluate`` joins these splits into one forward pass (they fit in one of ``limit`` samples,
        ``eval_pass``). Never with buffers=local: each client is evaluated with its own statistics."""
        return 1 < len(splits) and sum(self.n(split) for split in splits) <= limit and not self._local_buffers()


def _names(splits) -> list[tuple[str, str, str]]:
    return [(f"{split}_loss", f"{split}_acc", f"n_{split}") for split in splits]


def _record(names: list[tuple[str, str, str]], sizes: list[int], results: list[tuple]) -> dict:
    """An evaluation record: loss, accuracy and size per split (``names``: :func:`_names` of the splits)."""
    out: dict[str, float] = {}
    for (loss_key, acc_key, n_key), n, (loss, acc) in zip(names, sizes, results):
        out[loss_key], out[acc_key], out[n_key] = loss, acc, n
    return out


EVAL_BATCH = 4096  # samples per forward pass when several clients are evaluated together, at most


def eval_pass(model: nn.Module | Callable, x: torch.Tensor) -> int:
    """Samples per forward pass when splits or clients are evaluated together (training.pass_size)."""
    return training.pass_size(model, x, EVAL_BATCH)


def evaluate_together(model: nn.Module, clients: list[Client], splits=("val", "test"),
                      layouts: dict | None = None) -> list[dict]:
    """``client.evaluate(model, splits)`` for each of several clients with small splits (``small_eval``), in as
    few forward passes of at most ``eval_pass`` samples as whole clients allow: one model shared by 500
    clients of a few samples each is one forward pass instead of 500. ``layouts``: a dict the caller keeps,
    where the passes' inputs stay while the same clients are evaluated on the same split tensors (FedAvg's
    every round), so that they are not gathered from 500 clients again. The same split tensors (and splits,
    in the same order) give the same passes: a client whose split is replaced is laid out anew."""
    if not clients:
        return []
    splits = tuple(splits)
    limit = eval_pass(model, clients[0].splits[splits[0]][0])
    tensors = [t for c in clients for s in splits for t in c.splits[s]]  # identity, not content: kept alive
    last = layouts if layouts is not None and layouts.get("limit") == limit else {}
    same = len(last.get("tensors", ())) == len(tensors) and all(map(operator.is_, last["tensors"], tensors))
    passes = last["passes"] if same else _passes(clients, splits, limit)
    if layouts is not None and not same:  # the last layout only: a host evaluates one group a call
        layouts.update(limit=limit, tensors=tensors, passes=passes)
    names, k, out = _names(splits), len(splits), []
    for x, y, sizes in passes:
        results = training.evaluate_small(model, x, y, sizes, clients[0].settings.task)
        out.extend(_record(names, sizes[i:i + k], results[i:i + k]) for i in range(0, len(sizes), k))
    return out


def _passes(clients: list[Client], splits: tuple, limit: int) -> list[tuple]:
    """The clients' splits end to end, cut between whole clients into passes of at most ``limit`` samples
    (a client larger than that alone): (x, y, the split sizes client by client) per pass."""
    sizes = [[c.n(s) for s in splits] for c in clients]
    passes, start = [], 0
    while start < len(clients):
        end, total = start, 0
        while end < len(clients) and (end == start or total + sum(sizes[end]) <= limit):
            total, end = total + sum(sizes[end]), end + 1
        parts = [c.splits[s] for c in clients[start:end] for s in splits]
        passes.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]),
                       [n for per_client in sizes[start:end] for n in per_client]))
        start = end
    return passes
