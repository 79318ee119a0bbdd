"""How a pool of sample indices is divided among clients: one function per partition, each from a paper.

Every function takes the pool (indices into the dataset), the labels, the client-size weights and a numpy
Generator, and returns (per-client index arrays, per-client group or None). Sizes are relative weights
(all ones for `equal`, lognormal draws for `lognormal`); the partition turns them into counts.
Group-based partitions assign clients to groups either in contiguous blocks of near-equal size (FedFomo's
code: K=15, D=4 gives 4/4/4/3), or uniformly at random (FedeRiCo's paper: "in this particular random split"
one group holds a single client). ``group_assign="auto"`` is each paper's way: random for label-groups,
blocks for latent, rotation and permutation.
"""

from __future__ import annotations

import numpy as np

from rayfl.user_input import UserError


PARTITIONS = ("iid", "pathological", "dirichlet", "latent", "majority", "label-groups", "rotation",
              "permutation", "natural")
MIN_CLIENT_SAMPLES = 10  # PersFL DS-3 / pFedMe: every client gets at least ~10 samples


def size_weights(cfg, rng: np.random.Generator) -> np.ndarray:
    """Relative client sizes: equal, or ∝ lognormal(0, size_sigma) draws (PersFL DS-3)."""
    if cfg.sizes == "lognormal":
        return rng.lognormal(0.0, cfg.size_sigma, size=cfg.clients)
    return np.ones(cfg.clients)


def counts_from_weights(total: int, weights: np.ndarray, minimum: int = MIN_CLIENT_SAMPLES) -> np.ndarray:
    """Integer counts summing to total, ∝ weights, each at least min(minimum, total // K) (at least 1)."""
    k = len(weights)
    if total < k:
        raise UserError(f"clients={k}: more clients than the {total} samples available; use fewer clients")
    floor = max(1, min(minimum, total // k))
    if np.allclose(weights, weights[0]):
        return np.diff(np.linspace(0, total, k + 1).round().astype(np.int64))
    rest = total - floor * k
    share = rest * weights / weights.sum()
    counts = np.floor(share).astype(np.int64)
    remainder = rest - counts.sum()
    counts[np.argsort(-(share - counts), kind="stable")[:remainder]] += 1  # largest remainders
    return counts + floor


def blocks(num_clients: int, groups: int) -> np.ndarray:
    """Group of each client: contiguous near-equal blocks."""
    return np.concatenate([np.full(len(b), g) for g, b in enumerate(np.array_split(np.arange(num_clients), groups))])


def assign_groups(cfg, rng: np.random.Generator, paper: str) -> np.ndarray:
    """Group of each client: ``blocks``, or ``random`` (each client uniform over the groups, redrawn until
    no group is empty, so that ``groups`` means what it says); ``auto`` takes ``paper``, the paper's way."""
    how = paper if cfg.group_assign == "auto" else cfg.group_assign
    if how == "blocks":
        return blocks(cfg.clients, cfg.groups)
    while True:
        group_of = rng.integers(cfg.groups, size=cfg.clients)
        if len(np.unique(group_of)) == cfg.groups:
            return group_of


def _split_by_weights(idx: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    cuts = np.cumsum(counts_from_weights(len(idx), weights))[:-1]
    return np.split(idx, cuts)


def _check_groups(cfg, limit: int | None = None, what: str = "") -> None:
    if cfg.groups > cfg.clients:
        raise UserError(f"groups={cfg.groups}: more groups than clients={cfg.clients}; every group needs a client")
    if limit is not None and cfg.groups > limit:
        raise UserError(f"groups={cfg.groups}: at most {limit} {what}")


def _least_used(usage: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct classes among the least used so far, ties broken at random: balanced class coverage."""
    order = np.lexsort((rng.random(len(usage)), usage))[:k]
    usage[order] += 1
    return order


# --------------------------------------------------------------------------------------------- partitions

def natural(pool, client) -> list[np.ndarray]:
    """The data's own owners (LEAF's writers, a hospital's patients): client i holds the samples of the i-th
    distinct id of the client column, in sorted order, each in the dataset's order."""
    ids, owner = np.unique(client[pool], return_inverse=True)
    order = np.argsort(owner, kind="stable")
    return np.split(pool[order], np.cumsum(np.bincount(owner, minlength=len(ids)))[:-1])


def iid(cfg, pool, y, weights, rng):
    return _split_by_weights(rng.permutation(pool), weights), None


def pathological(cfg, pool, y, weights, rng, num_classes):
    """McMahan et al. shards: each client holds cfg.classes_per_client distinct classes; each class's samples
    (sorted by label, shuffled within) are cut into one shard per client holding it, sized by client weight.
    Classes are dealt least-used-first so every class is used about equally often."""
    k = cfg.classes_per_client
    if k > num_classes:
        raise UserError(f"classes_per_client={k}: more than the {num_classes} classes of the dataset")
    usage = np.zeros(num_classes, dtype=np.int64)
    owned = [_least_used(usage, k, rng) for _ in range(cfg.clients)]
    parts: list[list[np.ndarray]] = [[] for _ in range(cfg.clients)]
    labels = y[pool]
    for c in range(num_classes):
        holders = [i for i in range(cfg.clients) if c in owned[i]]
        if not holders:
            continue
        members = rng.permutation(pool[labels == c])
        if len(members) < len(holders):
            raise UserError(f"clients={cfg.clients}: class {c} has {len(members)} samples for {len(holders)} "
                            f"clients; use fewer clients or fewer classes_per_client")
        for i, shard in zip(holders, _split_by_weights(members, weights[holders])):
            parts[i].append(shard)
    return [rng.permutation(np.concatenate(p)) for p in parts], None


def dirichlet(cfg, pool, y, weights, rng, num_classes, alpha: float | None = None):
    """Per-class proportions over clients q_c ~ Dir(alpha), scaled by the client size weights (Hsu et al. /
    PersFL DS-2, per-class form). Redrawn up to 50 times until every client has MIN_CLIENT_SAMPLES (as
    NIID-Bench does); if that fails, the smallest clients take random samples from the largest."""
    labels = y[pool]
    by_class = [rng.permutation(pool[labels == c]) for c in range(num_classes)]
    minimum = max(1, min(MIN_CLIENT_SAMPLES, len(pool) // cfg.clients))
    if len(pool) < cfg.clients:
        raise UserError(f"clients={cfg.clients}: more clients than the {len(pool)} samples available")
    w = weights / weights.sum()
    for _ in range(50):
        parts: list[list[np.ndarray]] = [[] for _ in range(cfg.clients)]
        for members in by_class:
            q = rng.dirichlet(np.full(cfg.clients, alpha or cfg.alpha)) * w
            q = q / q.sum() if q.sum() > 0 else w
            cuts = (np.cumsum(q)[:-1] * len(members)).round().astype(np.int64)
            for i, part in enumerate(np.split(members, cuts)):
                parts[i].append(part)
        out = [np.concatenate(p) for p in parts]
        if min(map(len, out)) >= minimum:
            break
    for i in range(cfg.clients):  # fallback top-up
        while len(out[i]) < minimum:
            j = int(np.argmax([len(o) for o in out]))
            take = min(minimum - len(out[i]), len(out[j]) - minimum)
            moved = rng.choice(len(out[j]), size=take, replace=False)
            out[i] = np.concatenate([out[i], out[j][moved]])
            out[j] = np.delete(out[j], moved)
    return [rng.permutation(o) for o in out], None


def latent(cfg, pool, y, weights, rng, x):
    """FedFomo's latent distributions (Zhang et al., 2021, App. A.5): embed, PCA, k-means into cfg.groups
    clusters, clients assigned to clusters in blocks, each cluster fully divided among its clients. There is no pretrained VGG
    offline, so the embedding is PCA (up to 50 components) of the raw standardized pixels/features. Clusters
    are numbered by their centroid's first principal coordinate, so for 1-D data (the sine toy) group g is the
    g-th interval of x from the left."""
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA

    _check_groups(cfg)
    if cfg.groups > len(pool):
        raise UserError(f"groups={cfg.groups}: more groups than the {len(pool)} samples")
    feats = x[pool].reshape(len(pool), -1)  # float32: CIFAR in float64 would need 1.5 GB
    seed = int(rng.integers(2**31))
    n_comp = min(50, feats.shape[1], len(pool))
    if n_comp < feats.shape[1]:
        feats = PCA(n_components=n_comp, svd_solver="randomized", random_state=seed).fit_transform(feats)
    km = KMeans(n_clusters=cfg.groups, n_init=5, max_iter=100, random_state=seed).fit(feats)
    order = np.argsort(np.argsort(km.cluster_centers_[:, 0]))  # old cluster id -> new id
    cluster = order[km.labels_]
    group_of = assign_groups(cfg, rng, "blocks")
    return _fill_groups(pool, cluster, group_of, weights, rng), group_of


def _fill_groups(pool, pool_group, group_of, weights, rng) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None] * len(group_of)
    for g in range(int(group_of.max()) + 1):
        members = np.flatnonzero(group_of == g)
        data = rng.permutation(pool[pool_group == g])
        if len(data) < len(members):
            raise UserError(f"group {g} has {len(data)} samples for {len(members)} clients; use fewer clients "
                            f"or fewer groups")
        for i, part in zip(members, _split_by_weights(data, weights[members])):
            out[i] = part
    return out


def majority(cfg, pool, y, weights, rng, num_classes):
    """FedMoE's majority-class skew (Listo Zec et al., 2020, §4): each client has two majority classes that
    together take fraction cfg.majority of its samples (p/2 each), the rest spread evenly over the other classes;
    p = 2/C is iid. The pair is two distinct classes (the paper says "two majority classes"; its code's
    ordered pairs also allow (c, c)), dealt largest client first to the classes with the least demand so
    far. Where a class is over-demanded, the clients holding it as majority shrink (then all clients, if
    needed), so the fraction holds up to rounding."""
    p, k = cfg.majority, cfg.clients
    labels = y[pool]
    by_class = [rng.permutation(pool[labels == c]) for c in range(num_classes)]
    avail = np.array([len(b) for b in by_class])
    totals = counts_from_weights(len(pool), weights)
    load = np.zeros(num_classes)
    n_major = min(2, num_classes)
    major = np.zeros((k, n_major), dtype=np.int64)
    for i in np.argsort(-totals, kind="stable"):
        major[i] = np.lexsort((rng.random(num_classes), load))[:n_major]
        load[major[i]] += totals[i] / n_major / np.maximum(avail[major[i]], 1)

    def demand(totals):
        d = np.zeros((k, num_classes), dtype=np.int64)
        for i in range(k):
            n_maj = int(round(p * totals[i]))
            others = np.setdiff1d(np.arange(num_classes), major[i])
            d[i, major[i]] = np.diff(np.linspace(0, n_maj, n_major + 1).round().astype(np.int64))
            if len(others):
                even = np.diff(np.linspace(0, totals[i] - n_maj, len(others) + 1).round().astype(np.int64))
                d[i, others] = np.roll(even, i)  # spread the rounding remainder over different classes
        return d

    d = demand(totals)
    for step in range(60):
        ratio = d.sum(0) / np.maximum(avail, 1)
        if ratio.max() <= 1:
            break
        worst = ratio[major].max(axis=1)
        shrink = np.where(worst > 1, worst, 1.0) if step < 30 else np.full(k, ratio.max())
        totals = np.maximum(1, np.floor(totals / shrink * 0.999).astype(np.int64))
        d = demand(totals)
    if (d.sum(0) > avail).any():
        raise UserError(f"majority={p}: cannot be met with clients={k} on this dataset; use fewer clients")
    start = np.zeros(num_classes, dtype=np.int64)
    out = []
    for i in range(k):
        parts = []
        for c in range(num_classes):
            parts.append(by_class[c][start[c]:start[c] + d[i, c]])
            start[c] += d[i, c]
        out.append(rng.permutation(np.concatenate(parts)))
    return out, None


def label_groups(cfg, pool, y, weights, rng, num_classes):
    """FedeRiCo's label groups (Sui et al., 2022, §4.1): the classes are shuffled and cut into cfg.groups
    disjoint near-equal label groups; clients are assigned to groups at random (the paper;
    ``group_assign=blocks``: even blocks) and draw disjoint shares of their group's data."""
    _check_groups(cfg, num_classes, f"label groups: the dataset has {num_classes} classes")
    label_group = np.empty(num_classes, dtype=np.int64)
    for g, classes in enumerate(np.array_split(rng.permutation(num_classes), cfg.groups)):
        label_group[classes] = g
    group_of = assign_groups(cfg, rng, "random")
    return _fill_groups(pool, label_group[y[pool]], group_of, weights, rng), group_of


def grouped(cfg, pool, y, weights, rng, num_classes, limit=None, what=""):
    """Clients in cfg.groups groups (rotation / permutation: Mestoukirdi et al., 2021, §IV-A), each group's
    transform applied by the federation. The data is IID, or with ``label_shift`` = α > 0 split by
    Dirichlet(α) over labels as well (S2: "each with a different label distribution, as in S1", α = 0.4)."""
    _check_groups(cfg, limit, what)
    if cfg.label_shift > 0:
        parts, _ = dirichlet(cfg, pool, y, weights, rng, num_classes, alpha=cfg.label_shift)
    else:
        parts, _ = iid(cfg, pool, y, weights, rng)
    return parts, assign_groups(cfg, rng, "blocks")


def label_permutations(groups: int, num_classes: int, rng: np.random.Generator) -> list[list[int]]:
    """Group 0 keeps the identity; the others get distinct, non-identity seeded permutations."""
    import math

    if groups > math.factorial(num_classes):
        raise UserError(f"groups={groups}: only {math.factorial(num_classes)} label permutations of "
                        f"{num_classes} classes exist")
    perms = [tuple(range(num_classes))]
    while len(perms) < groups:
        p = tuple(int(v) for v in rng.permutation(num_classes))
        if p not in perms:
            perms.append(p)
    return [list(p) for p in perms]
