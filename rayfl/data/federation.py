"""A federation: which samples each client holds, its train/val/test split, and its transform.

Clients hold indices into the shared dataset arrays, never copies, so the driver can put the arrays in the
object store once and each actor materializes only its own clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from typing import TYPE_CHECKING

from rayfl.data import partition as P
from rayfl.data.partition import PARTITIONS
from rayfl.data.datasets import Dataset
from rayfl.user_input import UserError

if TYPE_CHECKING:
    from rayfl.config import Config

HOLDOUT_FRAC, HOLDOUT_MAX = 0.1, 1000  # FedMoE's global test set: n = 1000, balanced (Listo Zec et al., 2020, §4)
REGRESSION_PARTITIONS = ("iid", "latent", "natural")
# What a client costs the process that runs a federation before any actor starts (its index arrays, split and
# records): 3.8 KB a client measured with 10**6 clients of 3 samples each (4.7 GB, 0.9 GB of it the process).
CLIENT_BYTES = 4_000


@dataclass
class ClientData:
    train: np.ndarray  # int64 indices into dataset.x
    val: np.ndarray
    test: np.ndarray
    group: int | None = None  # latent/true group, where the partition has one
    # {"rotate": k} (k*90 degrees) or {"perm": [...]}; under cfg.ood, "eval" holds the transform of the client
    # whose (val, test) pair this client received, applied to val and test instead.
    transform: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)


@dataclass
class Federation:
    clients: list[ClientData]
    holdout: np.ndarray  # class-balanced global test set held by no client (empty for regression)


def _rng(cfg: Config, stage: int) -> np.random.Generator:
    """One independent stream per stage, so e.g. changing val_frac does not change who holds what."""
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, stage]))


def build_federation(cfg: Config, ds: Dataset) -> Federation:
    """Holdout first, then partition, cap, per-client split, OOD swap; deterministic in cfg.seed.

    The holdout is always carved before partitioning (classification only): min(10% of the data, 1000)
    samples, equal per class, so it is the same set for every partition and never overlaps a client."""
    _check(cfg, ds)
    # a natural partition's samples belong to their owners: no global holdout is taken from them
    holdout = _holdout(ds, _rng(cfg, 1)) if cfg.partition != "natural" else np.zeros(0, dtype=np.int64)
    pool = np.setdiff1d(np.arange(len(ds.y)), holdout)
    labels = ds.y if ds.task == "classification" else None
    rng = _rng(cfg, 2)
    weights = P.size_weights(cfg, _rng(cfg, 3))
    transforms = [{} for _ in range(cfg.clients)]
    name = cfg.partition
    if name == "natural":
        parts, groups = P.natural(pool, ds.client), None
    elif name == "iid":
        parts, groups = P.iid(cfg, pool, labels, weights, rng)
    elif name == "pathological":
        parts, groups = P.pathological(cfg, pool, labels, weights, rng, ds.num_classes)
    elif name == "dirichlet":
        parts, groups = P.dirichlet(cfg, pool, labels, weights, rng, ds.num_classes)
    elif name == "latent":
        parts, groups = P.latent(cfg, pool, labels, weights, rng, ds.x)
    elif name == "majority":
        parts, groups = P.majority(cfg, pool, labels, weights, rng, ds.num_classes)
    elif name == "label-groups":
        parts, groups = P.label_groups(cfg, pool, labels, weights, rng, ds.num_classes)
    elif name == "rotation":
        parts, groups = P.grouped(cfg, pool, labels, weights, rng, ds.num_classes, 4,
                                    "rotation groups (0/90/180/270 degrees)")
        transforms = [{"rotate": int(g)} if g else {} for g in groups]
    else:  # permutation
        parts, groups = P.grouped(cfg, pool, labels, weights, rng, ds.num_classes)
        perms = P.label_permutations(cfg.groups, ds.num_classes, _rng(cfg, 4))
        transforms = [{"perm": perms[g]} if g else {} for g in groups]
    if cfg.samples_per_client > 0:
        cap_rng = _rng(cfg, 5)
        parts = [_subsample(p, labels, cfg.samples_per_client, cap_rng) for p in parts]
    split_rng = _rng(cfg, 6)
    clients = []
    for i, idx in enumerate(parts):
        train, val, test = _split(i, idx, cfg, split_rng)
        group = None if groups is None else int(groups[i])
        clients.append(ClientData(train, val, test, group, transforms[i]))
    if cfg.ood:
        _swap_targets(clients, _rng(cfg, 7))
    return Federation(clients, holdout)


def _check(cfg: Config, ds: Dataset) -> None:
    if cfg.partition not in PARTITIONS:
        raise UserError(f"partition={cfg.partition!r}: unknown; allowed: {', '.join(PARTITIONS)}")
    if ds.task == "regression" and cfg.partition not in REGRESSION_PARTITIONS:
        raise UserError(f"partition={cfg.partition!r}: needs class labels; the regression dataset {ds.name!r} "
                        f"allows: {', '.join(REGRESSION_PARTITIONS)}")
    if cfg.partition == "rotation" and len(ds.input_shape) != 3:
        raise UserError(f"partition='rotation': needs images; dataset {ds.name!r} is tabular")
    if cfg.ood and cfg.clients < 2:
        raise UserError("ood=True: needs at least 2 clients to swap (val, test) pairs between")
    if cfg.partition == "natural":
        if ds.client is None:
            raise UserError(f"partition='natural': needs a dataset with a client column (a client id per sample); "
                            f"{ds.name!r} has none")
        owners = len(np.unique(ds.client))
        if cfg.clients != owners:
            raise UserError(f"clients={cfg.clients}: partition='natural' takes the {owners} clients of {ds.name!r}'s "
                            f"client column; set clients={owners}")
        if cfg.sizes != "equal":
            raise UserError(f"sizes={cfg.sizes!r}: partition='natural' keeps each client's own samples; "
                            f"allowed: equal")
    if cfg.clients > len(ds.y):
        raise UserError(f"clients={cfg.clients}: more clients than the {len(ds.y)} samples of {ds.name!r}")
    from rayfl.data.datasets import check_memory

    check_memory(f"clients={cfg.clients}", cfg.clients * CLIENT_BYTES, f"{cfg.clients:,} clients' records in this "
                 f"process (about {CLIENT_BYTES:,} bytes each)")


def _holdout(ds: Dataset, rng: np.random.Generator) -> np.ndarray:
    if ds.task != "classification":
        return np.zeros(0, dtype=np.int64)
    counts = np.bincount(ds.y, minlength=ds.num_classes)
    per_class = min(min(int(HOLDOUT_FRAC * len(ds.y)), HOLDOUT_MAX) // ds.num_classes, int(counts.min() * HOLDOUT_FRAC))
    if per_class == 0:
        return np.zeros(0, dtype=np.int64)
    picked = [rng.choice(np.flatnonzero(ds.y == c), per_class, replace=False) for c in range(ds.num_classes)]
    return np.sort(np.concatenate(picked)).astype(np.int64)


def _subsample(idx: np.ndarray, labels, cap: int, rng: np.random.Generator) -> np.ndarray:
    """At most cap samples, stratified by label (largest remainder) so the partition's class mix survives."""
    if len(idx) <= cap:
        return idx
    if labels is None:
        return rng.choice(idx, cap, replace=False)
    classes, inverse, counts = np.unique(labels[idx], return_inverse=True, return_counts=True)
    share = counts * cap / len(idx)
    take = np.floor(share).astype(np.int64)
    take[np.argsort(-(share - take), kind="stable")[: cap - take.sum()]] += 1
    kept = [rng.choice(idx[inverse == j], take[j], replace=False) for j in range(len(classes))]
    return rng.permutation(np.concatenate(kept))


def _split(i: int, idx: np.ndarray, cfg: Config, rng: np.random.Generator):
    """Shuffled test / val / train; a split with a positive fraction gets at least one sample, train too."""
    n = len(idx)
    n_test = max(int(round(cfg.test_frac * n)), 1 if cfg.test_frac > 0 else 0)
    n_val = max(int(round(cfg.val_frac * n)), 1 if cfg.val_frac > 0 else 0)
    if n - n_test - n_val < 1:
        raise UserError(f"client {i} has {n} samples: too few for train/val/test; use fewer clients or a larger "
                        f"samples_per_client")
    idx = rng.permutation(idx).astype(np.int64)
    return idx[n_test + n_val:], idx[n_test:n_test + n_val], idx[:n_test]


def _swap_targets(clients: list[ClientData], rng: np.random.Generator) -> None:
    """FedFomo's out-of-local-distribution setting (Zhang et al., 2021, §4): (val, test) pairs are shuffled
    among the clients, each keeping its train split. The authors' code uses a plain permutation (a client may
    keep its own pair); a derangement is used here so every client targets another client's data."""
    k = len(clients)
    while True:
        perm = rng.permutation(k)
        if not (perm == np.arange(k)).any():
            break
    pairs = [(c.val, c.test, {key: v for key, v in c.transform.items() if key != "eval"}) for c in clients]
    for i, c in enumerate(clients):
        c.val, c.test, source = pairs[perm[i]]
        c.transform = {**c.transform, "eval": source}


def _apply(x, y, transform: dict):
    import torch

    if transform.get("rotate"):
        x = torch.rot90(x, int(transform["rotate"]), dims=(-2, -1))
    if transform.get("perm") is not None:
        y = torch.as_tensor(transform["perm"], dtype=y.dtype)[y]
    return x, y


def materialize(ds_x: np.ndarray, ds_y: np.ndarray, client: ClientData, device="cpu") -> dict:
    """{"train": (x, y), "val": ..., "test": ...} as tensors on device, the client's transforms applied."""
    import torch

    own = {k: v for k, v in client.transform.items() if k != "eval"}
    target = client.transform.get("eval", own)
    out = {}
    for split, transform in (("train", own), ("val", target), ("test", target)):
        idx = getattr(client, split)
        x, y = _apply(torch.from_numpy(ds_x[idx]), torch.from_numpy(ds_y[idx]), transform)
        out[split] = (x.contiguous().to(device), y.to(device))
    return out
