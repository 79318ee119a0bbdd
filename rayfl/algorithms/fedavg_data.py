"""FedAvg + Data: FedAvg with a small globally shared data set (Zhao, Li, Lai, Suda, Civin, Chandra, "Federated
Learning with Non-IID Data", arXiv 1806.00582, 2018, §4).

The paper's data-sharing strategy: a set G that is uniform over the classes is held centrally; its size is

    β = |G| / |D| · 100%,   D: all of the clients' (training) data

At initialization a warm-up model trained on G, and a random α portion of G, go to every client; each client then
trains on its private data together with its share of G, and the server averages the local models as FedAvg
does. Evaluated like FedAvg: the global model.

How it is done here (the paper's choices first, then those it leaves open):
- G is drawn from the federation's held-out balanced set (the set FedMoE scores its global accuracy on, carved
  out before partitioning and held by no client), so every algorithm of a comparison sees the same clients.
  A FedAvg + Data run must therefore not report global accuracy: part of that set is in its training data.
- |G|: k = round(β |D| / C) samples of each of the C classes (β = ``data_frac``, |D| the sum of the clients'
  training splits), the first k of each class in one seeded shuffle of the held-out set: the same G for every
  client, and the same samples whatever the labels are renamed to (permutation partitions).
- α (``share_frac``): each client gets ⌈α k⌉ samples of each class of G, the first of each class in a shuffle
  seeded by the run's seed and the client's id ("a random α portion", drawn class by class so that it stays
  balanced); α = 1 gives every client all of G.
- The warm-up model: ``warmup_epochs`` epochs of minibatch SGD on all of G from the common initial model, with the
  run's optimizer, lr and batch size, before the first round. The paper does not say how long it is trained;
  rayfl's server holds no data, so client 0 (which holds the held-out set like every client) does it.
- Local training: FedAvg's (the run's epochs, lr, batch size) over the client's training split with its share of
  G appended, the minibatches drawn from both shuffled together (the paper: "trained on the shared data from G
  together with the private data"). FedAvg's weights are the sizes of these enlarged sets; validation and test
  splits are never enlarged.
- The shared samples come as the held-out set reaches the client: under its evaluation transform (rotation /
  permutation partitions; under ``ood`` the transform of the client whose val/test pair it holds).
- Refused before any actor starts: a regression task (no classes to balance, ``check_config``) and a held-out set
  with fewer than k samples of a class (``check_run``, once the federation is built).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rayfl.algorithms.base import Algorithm
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import weighted_mean

REGRESSION_DATASETS = ("sine",)
SHARED_SEED = 0xDA7A  # mixed with the run's seed: the draws of G and of each client's share
SCRATCH_SPLIT = "train+shared"  # the name the enlarged training set has during one fit


@dataclass
class FedAvgDataParams:
    data_frac: float = 0.05  # β = |G| / |D|: 5%, the paper's headline (~30% more accuracy on CIFAR-10; abstract, §4)
    share_frac: float = 1.0  # α: the portion of G each client receives (§4); 1: every client gets all of G
    warmup_epochs: int = 1  # epochs on G for the warm-up model (§4 gives none; 0: start from the initial model)

    def check(self, n_clients: int) -> None:
        if not 0 <= self.data_frac <= 1:  # NaN fails too
            raise ValueError(f"data_frac={self.data_frac}: must be in [0, 1] (0 is FedAvg)")
        if not 0 < self.share_frac <= 1:
            raise ValueError(f"share_frac={self.share_frac}: must be in (0, 1]")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={self.warmup_epochs}: must be an integer >= 0")

    def check_config(self, cfg) -> None:
        if self.data_frac > 0 and cfg.dataset in REGRESSION_DATASETS:
            raise ValueError(no_holdout(self.data_frac))

    def check_run(self, info, model) -> None:
        """G must fit in the held-out balanced set (the same check the clients make, before any of them starts)."""
        if self.data_frac > 0:
            counts = info.holdout_counts or []
            per_class(self.data_frac, sum(info.n_train), np.repeat(np.arange(len(counts)), counts))


def no_holdout(data_frac: float) -> str:
    return (f"data_frac={data_frac}: the shared data is a class-balanced part of the held-out set, which this "
            f"task has none of (regression, or too few samples per class); allowed: data_frac=0, or a "
            f"classification dataset")


# ------------------------------------------------------------------------------------------- the shared set

def per_class(data_frac: float, n_total: int, labels: np.ndarray) -> int:
    """k = round(β |D| / C): G's samples per class, for |G| = β |D| (§4) split evenly over the C classes of the
    held-out set ``labels``; ValueError (naming data_frac and what is possible) when the set cannot give them."""
    classes, counts = np.unique(labels, return_counts=True)
    if len(classes) == 0:
        raise ValueError(no_holdout(data_frac))
    c, have = len(classes), int(counts.min())
    k = math.floor(data_frac * n_total / c + 0.5)
    if not 1 <= k <= have:
        raise ValueError(f"data_frac={data_frac}: asks {k} shared samples per class ({data_frac} x {n_total} "
                         f"training samples over {c} classes), the held-out balanced set has {have}; allowed here: "
                         f"0, or {c / (2 * n_total):.4g} <= data_frac <= {have * c / n_total:.4g}")
    return k


def first_per_class(labels: np.ndarray, order: np.ndarray, k: int) -> np.ndarray:
    """The positions of the first k members of each class along ``order`` (positions into ``labels``), sorted."""
    ranked = labels[order]
    keep = np.zeros(len(order), dtype=bool)
    for c in np.unique(ranked):
        keep[np.flatnonzero(ranked == c)[:k]] = True
    return np.sort(order[keep])


def shared_set(labels: np.ndarray, k: int, seed: int) -> np.ndarray:
    """G (§4): k samples of each class of the held-out set, the same for every client (positions into it)."""
    order = np.random.default_rng([seed, SHARED_SEED]).permutation(len(labels))
    return first_per_class(labels, order, k)


def client_share(labels: np.ndarray, shared: np.ndarray, k: int, share_frac: float, seed: int, cid: int) -> np.ndarray:
    """A random α portion of G for client ``cid`` (§4): ⌈α k⌉ of each class of G; all of G when α = 1."""
    order = np.random.default_rng([seed, SHARED_SEED, cid]).permutation(shared)
    return first_per_class(labels, order, math.ceil(share_frac * k))


# ------------------------------------------------------------------------------------------- the algorithm

class FedAvgDataServer(FedAvgServer):
    averages = "global_ref"  # FedAvg's averaging (user-level DP clips and noises it); the warm-up reads only G

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # what a client needs to draw G and its share: |D| and the run's seed (the message of every call)
        self.share = {"n_total": int(sum(self.info.n_train)), "seed": int(self.info.seed)} \
            if self.params.data_frac > 0 else {}

    def setup(self, call):
        """The warm-up model trained on G (§4), on client 0, before the first round; also the check that G can be
        drawn (the same held-out set and |D| for every client: one client's check is every client's)."""
        if not self.share:
            return {}
        up = call("warmup", {0: {"models": {"global": self.global_ref}, **self.share}})[0]
        if "weights" in up:
            self.global_ref = self.put(up["weights"])
        return {k: up[k] for k in ("shared_per_class", "shared_size", "warmup_loss") if k in up}

    def run_round(self, stage, rnd, participants, call):
        msg = {"models": {"global": self.global_ref}, **self.share}
        ups = self.train_and_average(call, dict.fromkeys(participants, msg))
        return {"train_loss": weighted_mean(ups, "train_loss")}


class FedAvgDataClient(FedAvgClient):
    # client.fit; the shared set G is public, so the steps on it (the warm-up too) count, conservatively
    private_training = True

    uses_holdout = True  # the host adds the held-out balanced set as client.splits["global"]

    def shared(self, client, msg) -> tuple[np.ndarray, np.ndarray, int]:
        """(G, this client's share of it, k) as positions into the held-out set."""
        if "global" not in client.splits:
            raise ValueError(no_holdout(self.params.data_frac))
        labels = client.splits["global"][1].cpu().numpy()
        k = per_class(self.params.data_frac, msg["n_total"], labels)
        g = shared_set(labels, k, msg["seed"])
        return g, client_share(labels, g, k, self.params.share_frac, msg["seed"], client.cid), k

    def step_warmup(self, client, msg, models):
        """The warm-up model (§4): ``warmup_epochs`` epochs on all of G from the message's (initial) model."""
        g, _, k = self.shared(client, msg)
        out = {"shared_per_class": float(k), "shared_size": float(len(g))}
        if self.params.warmup_epochs:
            model = client.scratch(models["global"])
            result = fit_on(client, model, take(client.splits["global"], g), epochs=self.params.warmup_epochs)
            out.update(weights=client.vector(model), warmup_loss=result["train_loss"])
        return out

    def local_fit(self, client, model, msg):
        """FedAvg's local training on the client's training split together with its share of G (§4)."""
        if not msg.get("n_total"):  # data_frac = 0: FedAvg
            return client.fit(model)
        _, mine, _ = self.shared(client, msg)
        (x, y), (gx, gy) = client.splits["train"], take(client.splits["global"], mine)
        return fit_on(client, model, (torch.cat([x, gx]), torch.cat([y, gy])))


def take(split: tuple, positions: np.ndarray) -> tuple:
    x, y = split
    idx = torch.as_tensor(positions, device=x.device)
    return x[idx], y[idx]


def fit_on(client, model, data: tuple, **kw) -> dict:
    """``client.fit`` on ``data`` (x, y) in place of its training split, which is left as it was. The enlarged
    set is made for the call and let go after it: at 1,000 held-out images per client, keeping it would cost
    a host of 1,000 clients gigabytes."""
    client.splits[SCRATCH_SPLIT] = data
    try:
        return client.fit(model, split=SCRATCH_SPLIT, **kw)
    finally:
        del client.splits[SCRATCH_SPLIT]


ALGORITHMS = [
    Algorithm("fedavg-data", FedAvgDataParams, FedAvgDataServer, FedAvgDataClient,
              "FedAvg with a small class-balanced data set shared with every client (Zhao et al. 2018)"),
]
