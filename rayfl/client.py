"""A client: its data splits, its model, its personal state, and the local-training settings.

A Client lives for the whole experiment inside one host (a Ray actor, or the test process), so that
nothing personal is shipped back and forth between rounds. Algorithms reach everything they need
through it: ``fit`` and ``evaluate`` for the common work, ``state`` for their own.
"""

from __future__ import annotations

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

    @classmethod
    def from_config(cls, cfg, task: str) -> "TrainSettings":
        return cls(task, cfg.local_epochs, cfg.lr, cfg.batch_size, cfg.optimizer, cfg.momentum,
                   cfg.weight_decay)


class Client:
    def __init__(self, cid: int, splits: dict, make_model: Callable[[], nn.Module], initial: np.ndarray,
                 settings: TrainSettings, seed: int, device: str = "cpu",
                 share: Callable[[Any], Any] = lambda v: v, group: int | None = None,
                 scratch: dict | None = None):
        self.cid = cid
        self.splits = splits  # {"train": (x, y), "val": (x, y), "test": (x, y)} tensors on device
        self.device = device
        self.settings = settings
        self.group = group
        self.share = share  # wraps a vector so that it travels as a handle (ray.put under Ray)
        self._make_model = make_model
        self._scratch = scratch if scratch is not None else {}  # one spare model, shared by a host's clients
        self.model = self.new_model(initial)
        self.state: dict[str, Any] = {}  # the algorithm's personal state (teacher, row of P, ...)
        self.rng = np.random.default_rng([seed, cid])
        self.gen = torch.Generator().manual_seed(int(self.rng.integers(2**62)))
        self.optimizer = None  # an algorithm that keeps optimizer state across rounds sets it

    # --- sizes -----------------------------------------------------------------------------------
    def n(self, split: str = "train") -> int:
        return int(self.splits[split][0].shape[0])

    # --- models ----------------------------------------------------------------------------------
    def new_model(self, vec: np.ndarray | None = None) -> nn.Module:
        """A fresh copy of the architecture on this client's device, loaded from ``vec`` if given."""
        model = self._make_model().to(self.device)
        if vec is not None:
            training.load_vector(model, vec)
        return model

    def load(self, vec: np.ndarray, model: nn.Module | None = None) -> nn.Module:
        return training.load_vector(model if model is not None else self.model, vec)

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
            optimizer = training.make_optimizer(model.parameters(), s.optimizer, lr or s.lr, s.momentum,
                                                s.weight_decay)
        x, y = self.splits[split]
        if x.shape[0] == 0:
            return {"train_loss": float("nan"), "n": 0}
        loss = training.train_epochs(model, x, y, epochs or s.local_epochs, s.batch_size, optimizer,
                                     loss_fn or training.loss_fn_for(s.task), self.gen)
        return {"train_loss": loss, "n": int(x.shape[0])}

    def loss_of(self, vec: np.ndarray, split: str = "val") -> float:
        """Loss of a weight vector on a split, in the host's spare model (no allocation per candidate):
        how FedFomo weighs downloads and PersFL checks teacher candidates."""
        if "model" not in self._scratch:
            self._scratch["model"] = self.new_model()
        return self.loss(self.load(vec, self._scratch["model"]), split)

    def loss(self, model: nn.Module, split: str = "val") -> float:
        x, y = self.splits[split]
        return training.evaluate(model, x, y, self.settings.task)[0]

    def evaluate(self, model: nn.Module | Callable, splits=("val", "test")) -> dict:
        """Loss and accuracy of ``model`` on each split, with split sizes: the loop's evaluation record."""
        out: dict[str, float] = {}
        for split in splits:
            x, y = self.splits[split]
            loss, acc = training.evaluate(model, x, y, self.settings.task)
            out[f"{split}_loss"], out[f"{split}_acc"], out[f"n_{split}"] = loss, acc, int(x.shape[0])
        return out
