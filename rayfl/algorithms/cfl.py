"""Clustered Federated Learning, CFL (Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic
Distributed Multitask Optimization Under Privacy Constraints", IEEE TNNLS 32(8), 2021; arXiv 1910.01991, 2019).

FedAvg runs inside each cluster; every client starts in one cluster, C = {{1, ..., m}} (Algorithm 2, init).
Each round every participant i of cluster c trains from the cluster's model θ_c with the run's local_epochs,
batch_size and lr (FedAvg's budget), and the server forms its weight update (Sec. II; the paper's "weight
updates as generalized gradients" stand in for the risk gradients ∇r_i of its theory)

    Δθ_i = SGD_n(θ_c, D_i) - θ_c.

Then, per cluster c with participants (Algorithm 2, the loop over C):

    Δθ_c = Σ_{i∈c} |D_i| Δθ_i / Σ_{i∈c} |D_i|              the FL update (Sec. II) within c
    ||Δθ_c|| < ε1  and  max_{i∈c} ||Δθ_i|| > ε2              the criterion (Sec. III, congruent vs incongruent
                                                             clients): c's FL objective is stationary, some
                                                             client's is not; only then c is bipartitioned:
    α_{i,j} = <Δθ_i, Δθ_j> / (||Δθ_i|| ||Δθ_j||)           cosine similarity (Sec. III, separation theorem)
    c1, c2 = argmin_{c1 ∪ c2 = c} max_{i∈c1, j∈c2} α_{i,j}  the optimal bipartition (Algorithm 1)
    α_cross = max_{i∈c1, j∈c2} α_{i,j}; the split is made if γ_max < sqrt((1 - α_cross) / 2)   (Algorithm 2)
    θ_k ← θ_k + Δθ_k for every cluster k of the new C       each child averages only its own half's updates;
                                                             c's pre-split model θ*_c stays in the tree

Clusters split again whenever the criterion holds for them (recursion: Algorithm 2 runs the loop over the
current C every round). Each client is evaluated on its cluster's model, the model the paper trains for it.

Choices (where the paper is silent the authors' code, felisat/clustered-federated-learning, decides):
- Algorithm 1 merges the pairs (i, j) in decreasing α_{i,j} order until two clusters remain: single linkage,
  which attains the argmin exactly. The authors' code instead runs complete linkage on -α (scikit-learn's
  AgglomerativeClustering), which need not attain it; ``linkage="complete"`` reproduces that (the paper wins
  by default). Both use the Lance-Williams update here; ties go to the first pair in index order.
- Averages are size-weighted, |D_i| / |D_c| (Sec. II's FL update); the code takes the plain mean both for the
  cluster update and for ||Δθ_c||. ||Δθ_c|| is the norm of the (weighted) mean update, not the mean of the
  norms, read off the cluster's average (Σ |D_i| Δθ_i / Σ |D_i| = Σ |D_i| θ_i / Σ |D_i| - θ_c, which the server
  forms anyway); max_i ||Δθ_i|| the largest single update norm, each computed by its client (which holds θ_i
  and θ_c) and uploaded beside θ_i, so that the server does not pass over every update again.
- ε1 = 0.4, ε2 = 1.6, no split before round 20 and only clusters of more than 2 clients: the code's values
  (its EMNIST demo); the paper gives no universal ε (they depend on model, lr and local steps) and no
  warm-up or minimum size. ``min_split_size=2`` and ``min_rounds=0`` are the paper's Algorithm 2 as written.
- γ_max defaults to 0: then the check passes for any α_cross < 1, which is what the code does (it has no
  γ check); a larger γ_max is the paper's guard against a split the data do not support.
- The code decays its SGD learning rate by 0.99 per round and keeps momentum 0.9 across rounds; here every
  client trains with the run's settings (equal budgets). Its notebook finally gives each client the best of
  all cached tree models by accuracy on the client's held-out data; here a client is evaluated on its current
  cluster model (choosing on test data would not be a fair report).
- A client's trained weights θ_i go into its cluster's size-weighted sum in its host (FedAvg's reduction, one
  sum per tree node), so the cluster model Σ |D_i| θ_i / Σ |D_i| is FedAvg's own average to the bit: before
  any split CFL is FedAvg. The client also leaves θ_i as a handle, which the server fetches only in a round
  that reads single updates (a split examined, a client routed, the last round's similarities) and, knowing
  θ_c, forms Δθ_i = θ_i - θ_c: the same information as uploading Δθ_i. The updates are kept in float32; their
  weighted sums are taken in float64, their Gram matrix <Δθ_i, Δθ_j> in float32.
- Partial participation (the paper has every client train every round): the criterion and the bipartition of
  a cluster read its participants only, ``min_split_size`` counts participants, and a cluster none of whose
  clients took part keeps its model unchanged and is not examined. Members of a split cluster that did not
  take part stay at the split node of the parameter tree with its cached model θ*_c; when next sampled such a
  client trains from θ*_c and moves down to the child "whose client updates are more similar" (Sec. IV,
  parameter trees / new clients): the child k maximising α(Δθ_i, Σ_{j∈c_k} Δθ_j / ||Δθ_j||), the summed unit
  updates of the child's members at the split (the paper does not say how a branch's updates are compared;
  two vectors per split are kept). Its update, made from θ*_c, is averaged into no cluster that round.
- An update of norm 0 (a client with no training data) has cosine similarity 0 with every update.
- The similarities α are formed in a round where some cluster meets the criterion, as Algorithm 2 forms them,
  and in the run's last round (the code forms them every round, to show them): the ``similarity`` artifact
  holds those of the last round that formed them, the run's last unless it stopped early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rayfl.algorithms.base import Algorithm, ClientLogic, Server
from rayfl.algorithms.common import weighted_mean
from rayfl.reduce import WeightedMean, accumulate, combine

LINKAGES = ("single", "complete")  # single: the paper's Algorithm 1; complete: the authors' code
SPLIT_STATS = ("alpha_cross", "gamma_bound", "mean_update_norm", "max_update_norm")  # kept per split node
MEAN = WeightedMean("weights", by="n")
CLUSTER_MEANS = WeightedMean("weights", by="n", group="node")  # a tree node's participants, summed by hosts


@dataclass
class CFLParams:
    eps1: float = 0.4  # ε1: split only if ||Δθ_c|| < ε1 (authors' code's value; the paper tunes it per task)
    eps2: float = 1.6  # ε2: split only if max_i ||Δθ_i|| > ε2 (authors' code's value)
    gamma_max: float = 0.0  # γ_max of Algorithm 2: split only if γ_max < sqrt((1 - α_cross)/2); 0: the code
    min_rounds: int = 20  # no split before this round, counted from 0 (authors' code: c_round > 20, from 1)
    min_split_size: int = 3  # participants a cluster needs to be split (code: len(cluster) > 2; paper: 2)
    linkage: str = "single"  # bipartition: single = the paper's Algorithm 1, complete = the authors' code

    def check(self, n_clients: int) -> None:
        for name in ("eps1", "eps2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value}: must be a finite number >= 0")
        if not 0 <= self.gamma_max < 1:
            raise ValueError(f"gamma_max={self.gamma_max}: must be in [0, 1)")
        if self.min_rounds < 0:
            raise ValueError(f"min_rounds={self.min_rounds}: must be >= 0")
        if not 2 <= self.min_split_size <= n_clients:
            raise ValueError(f"min_split_size={self.min_split_size}: must be between 2 and the number of clients "
                             f"({n_clients})")
        if self.linkage not in LINKAGES:
            raise ValueError(f"linkage={self.linkage!r}: allowed: {', '.join(LINKAGES)}")


# ------------------------------------------------------------------------------------------- the math

def cosine_similarities(deltas: np.ndarray) -> np.ndarray:
    """α_{i,j} = <Δθ_i, Δθ_j> / (||Δθ_i|| ||Δθ_j||) for every pair of rows (Sec. III, separation theorem),
    from their Gram matrix (float32 updates stay float32: no float64 copy of every update), clipped to [-1, 1];
    0 in the row and column of an update of norm 0."""
    d = np.asarray(deltas)
    gram = (d if d.dtype == np.float32 else d.astype(np.float64)) @ d.T
    norms = np.sqrt(np.diag(gram).astype(np.float64))
    scale = np.outer(norms, norms)
    alpha = np.divide(gram, scale, out=np.zeros(scale.shape), where=scale > 0)
    return np.clip(alpha, -1.0, 1.0)


def update_norm(trained: np.ndarray, start: np.ndarray) -> float:
    """||Δθ_i|| = ||θ_i - θ_c|| in float64: one client's update norm, the criterion's max_i ||Δθ_i|| (Sec. III,
    congruent vs incongruent clients). Computed by the client, which holds both vectors."""
    d = np.subtract(trained, start, dtype=np.float64)
    return float(np.sqrt(d @ d))


def mean_update_norm(average: np.ndarray, start: np.ndarray) -> float:
    """||Δθ_c|| = ||Σ |D_i| Δθ_i / Σ |D_i||| (Sec. II's FL update) = ||Σ |D_i| θ_i / Σ |D_i| - θ_c||: the
    cluster average's step away from the model its clients trained from, what the criterion reads as
    stationarity."""
    return update_norm(average, start)


def split_criterion(mean_norm: float, max_norm: float, eps1: float, eps2: float) -> bool:
    """Algorithm 2's test: the cluster's FL objective is near stationary (||Δθ_c|| < ε1) while some client's is
    not (max_i ||Δθ_i|| > ε2), so the cluster is incongruent (Sec. III). Both strict."""
    return mean_norm < eps1 and max_norm > eps2


def bipartition(alpha: np.ndarray, linkage: str = "single") -> tuple[list[int], list[int]]:
    """Algorithm 1: merge clusters along the pairs in decreasing α order until two remain (single linkage, the
    exact argmin over bipartitions of the largest cross similarity); ``complete``: the authors' code's complete
    linkage on -α. Returns the two index lists, sorted, the one holding index 0 first."""
    m = alpha.shape[0]
    if m < 2:
        raise ValueError(f"a bipartition needs at least 2 clients, got {m}")
    link = np.array(alpha, dtype=np.float64)
    np.fill_diagonal(link, -np.inf)
    merge = np.maximum if linkage == "single" else np.minimum  # cluster-to-cluster similarity (Lance-Williams)
    members = [[i] for i in range(m)]
    while len(members) > 2:
        a, b = np.unravel_index(int(np.argmax(link)), link.shape)  # the most similar pair of clusters, a < b
        row = merge(link[a], link[b])
        link[a], link[:, a] = row, row
        link[a, a] = -np.inf
        link = np.delete(np.delete(link, b, axis=0), b, axis=1)
        members[a] = sorted(members[a] + members.pop(b))
    return members[0], members[1]


def cross_similarity(alpha: np.ndarray, c1: list[int], c2: list[int]) -> float:
    """α_cross = max_{i∈c1, j∈c2} α_{i,j}: what the optimal bipartition minimises (Algorithm 2)."""
    return float(np.max(alpha[np.ix_(c1, c2)]))


def gamma_bound(alpha_cross: float) -> float:
    """sqrt((1 - α_cross) / 2): the largest relative approximation error γ of the clients' updates under which
    the bipartition is still guaranteed correct (Sec. III, the separation theorem with noisy gradients)."""
    return math.sqrt(max(0.0, (1.0 - alpha_cross) / 2.0))


def accept_split(alpha_cross: float, gamma_max: float) -> bool:
    """Algorithm 2: make the split only if γ_max < sqrt((1 - α_cross) / 2)."""
    return gamma_max < gamma_bound(alpha_cross)


def branch_direction(deltas: np.ndarray) -> np.ndarray:
    """Σ_j Δθ_j / ||Δθ_j|| over one child's members at a split: what a client that missed the split is compared
    with on its way down the parameter tree (Sec. IV; our reading, see the module docstring)."""
    d = np.asarray(deltas, dtype=np.float64)
    norms = np.linalg.norm(d, axis=1, keepdims=True)
    return np.divide(d, norms, out=np.zeros_like(d), where=norms > 0).sum(axis=0)


def route(delta: np.ndarray, directions: np.ndarray) -> int:
    """The child (0 or 1) whose branch direction is most similar to this update (ties: the first)."""
    return int(np.argmax(cosine_similarities(np.vstack([delta, directions]))[0, 1:]))


def cluster_average(vectors: list[np.ndarray], n: list[float]) -> np.ndarray:
    """Σ |D_i| θ_i / Σ |D_i| over a cluster's trained models, summed as FedAvg's WeightedMean sums them (float64,
    in client order), so that a cluster that never split holds FedAvg's model to the bit."""
    partial: dict = {}
    for vec, w in zip(vectors, n):
        accumulate(MEAN, {"weights": vec, "n": w}, partial)
    return combine(MEAN, [partial])["weights"]


# ------------------------------------------------------------------------------------------- driver

class CFLServer(Server):
    """The parameter tree: node 0 is the root cluster; a split node keeps its pre-split model θ*_c and gets
    two children. Leaves are the current clusters; a client sits at a leaf, or at a split node while it awaits
    routing (it missed the split)."""

    growing_state = ("split_stats",)  # a row per tree node: checked on resume by dtype and dimensions only

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.info.n_clients
        self.models: list = [self.initial]  # node -> handle: a leaf's current model, a split node's θ*_c
        self.parent: list[int] = [-1]
        self.created: list[int] = [-1]  # round the node was made in (-1: before the first round)
        self.split_at: list[int] = [-1]  # round the node split in (-1: a leaf)
        self.split_stats: list[list[float]] = [[np.nan] * len(SPLIT_STATS)]  # NaN: not split
        self.directions: dict[int, np.ndarray] = {}  # split node -> its two children's branch directions
        self.node_of = np.zeros(k, dtype=np.int64)
        self.last_ids = np.zeros(0, dtype=np.int64)  # last round's participants, and their similarities
        self.last_alpha = np.zeros((0, 0))

    def children(self, node: int) -> list[int]:
        return [j for j, p in enumerate(self.parent) if p == node]

    def leaves(self) -> list[int]:
        return [j for j, s in enumerate(self.split_at) if s < 0]

    def messages(self, cids: list[int]) -> dict[int, dict]:
        """One message per tree node (a host resolves it once for all of that node's clients)."""
        per_node = {v: {"models": {"cluster": self.models[v]}, "node": v} for v in set(self.node_of[cids].tolist())}
        return {c: per_node[int(self.node_of[c])] for c in cids}

    def run_round(self, stage, rnd, participants, call):
        ups = call("train", self.messages(participants), reduce=CLUSTER_MEANS)
        averages = ups.reduced["weights"]  # node -> Σ |D_i| θ_i / Σ |D_i| over its participants with data
        ids = sorted(ups)
        start = [int(self.node_of[c]) for c in ids]  # where each participant trained from
        nodes = sorted(set(start))
        base = dict(zip(nodes, self.get([self.models[v] for v in nodes])))
        n = np.array([float(ups[c]["n"]) for c in ids])
        norms = np.array([float(ups[c]["update_norm"]) for c in ids])
        trained: dict = {}  # participant -> θ_i, fetched when the round reads single models (splits, routing)
        deltas = alpha = None  # Δθ_i and α_{i,j}: formed when a cluster meets the criterion (Algorithm 2)
        mean_norms, max_norms, splits = [], [], 0
        for node in nodes:
            rows = [r for r, v in enumerate(start) if v == node]
            if self.split_at[node] >= 0:  # clients that missed this node's split: one step down the tree
                for r in rows:
                    delta = np.subtract(self.trained(ups, [ids[r]], trained)[0], base[node])
                    self.node_of[ids[r]] = self.children(node)[route(delta, self.directions[node])]
                continue
            average = averages.get(node)
            if average is None:  # nobody with training data: the model stays
                continue
            mean_norm, max_norm = mean_update_norm(average, base[node]), float(norms[rows].max())
            mean_norms.append(mean_norm)
            max_norms.append(max_norm)
            halves = None
            if (rnd >= self.params.min_rounds and len(rows) >= self.params.min_split_size
                    and split_criterion(mean_norm, max_norm, self.params.eps1, self.params.eps2)):
                if alpha is None:
                    deltas, alpha = self.similarities(ids, start, self.trained(ups, ids, trained), base)
                sub = alpha[np.ix_(rows, rows)]
                c1, c2 = bipartition(sub, self.params.linkage)
                cross = cross_similarity(sub, c1, c2)
                if accept_split(cross, self.params.gamma_max):
                    halves = [[rows[i] for i in c1], [rows[i] for i in c2]]
                    self.split(node, rnd, halves, deltas, [cross, gamma_bound(cross), mean_norm, max_norm])
                    splits += 1
            if halves is None:  # FedAvg's step within the cluster
                self.models[node] = self.put(average)
                continue
            for half, child in zip(halves, self.children(node)):  # each child: the average of its own half's updates
                weighted = [r for r in half if n[r] > 0]
                if weighted:
                    self.models[child] = self.put(cluster_average(self.trained(ups, [ids[r] for r in weighted],
                                                                               trained), list(n[weighted])))
                for r in half:
                    self.node_of[ids[r]] = child
        if alpha is None and rnd == self.info.rounds - 1:  # the run's last round: its similarities are reported
            _, alpha = self.similarities(ids, start, self.trained(ups, ids, trained), base)
        if alpha is not None:
            self.last_ids, self.last_alpha = np.array(ids, dtype=np.int64), alpha
        return {"train_loss": weighted_mean(ups, "train_loss"), "clusters": len(self.leaves()), "splits": splits,
                "awaiting_routing": int(sum(self.split_at[v] >= 0 for v in self.node_of.tolist())),
                "mean_update_norm": max(mean_norms, default=float("nan")),  # max over clusters of ||Δθ_c||
                "max_update_norm": max(max_norms, default=float("nan"))}  # max over participants of ||Δθ_i||

    def trained(self, ups, cids: list[int], fetched: dict) -> list[np.ndarray]:
        """These participants' trained models θ_i, fetched once a round (most rounds read none: their hosts
        averaged them)."""
        missing = [c for c in cids if c not in fetched]
        fetched.update(zip(missing, self.get([ups[c]["trained"] for c in missing])))
        return [fetched[c] for c in cids]

    @staticmethod
    def similarities(ids: list[int], start: list[int], trained: list[np.ndarray], base: dict):
        """The round's updates Δθ_i = θ_i - θ_c, one row each, and their cosine similarities α_{i,j}."""
        deltas = np.empty((len(ids), np.size(trained[0])), np.float32)  # written in place, row by row
        for row, vec, v in zip(deltas, trained, start):
            np.subtract(vec, base[v], out=row)
        return deltas, cosine_similarities(deltas)

    def split(self, node: int, rnd: int, halves: list[list[int]], deltas: np.ndarray, stats: list[float]) -> None:
        """Node becomes a split node (its model, θ*_c, is kept) with two new leaves, one per half."""
        for _ in halves:
            self.models.append(self.models[node])  # replaced by the half's average by the caller
            self.parent.append(node)
            self.created.append(rnd)
            self.split_at.append(-1)
            self.split_stats.append([np.nan] * len(SPLIT_STATS))
        self.split_at[node] = rnd
        self.split_stats[node] = stats
        self.directions[node] = np.stack([branch_direction(deltas[h]) for h in halves])

    def eval_messages(self, stage, rnd, cids):
        return self.messages(cids)

    def final_model(self):
        leaves = self.leaves()
        return self.models[leaves[0]] if len(leaves) == 1 else None  # one cluster: FedAvg's global model

    def round_artifacts(self, rnd):
        return {"cluster": self.node_of.copy()}

    def artifacts(self):
        import pandas as pd

        k = self.info.n_clients
        similarity = np.full((k, k), np.nan)
        similarity[np.ix_(self.last_ids, self.last_ids)] = self.last_alpha
        tree = pd.DataFrame({
            "cluster": range(len(self.parent)), "parent": self.parent, "created_step": self.created,
            "split_step": self.split_at,
            "children": [" ".join(map(str, self.children(v))) for v in range(len(self.parent))],
            "clients_now": [int(np.sum(self.node_of == v)) for v in range(len(self.parent))],
            **{name: [s[i] for s in self.split_stats] for i, name in enumerate(SPLIT_STATS)}})
        return {"cluster": self.node_of.copy(),
                "same_cluster": (self.node_of[:, None] == self.node_of[None, :]).astype(np.float64),
                "similarity": similarity, "split_tree": tree}

    def state_dict(self):
        split_nodes = sorted(self.directions)
        return {"models": self.get(list(self.models)), "parent": list(self.parent), "created": list(self.created),
                "split_at": list(self.split_at), "split_stats": np.array(self.split_stats, dtype=np.float64),
                "direction_nodes": split_nodes, "directions": [self.directions[v] for v in split_nodes],
                "node_of": self.node_of.copy(), "last_ids": self.last_ids.copy(),
                "last_alpha": self.last_alpha.copy()}

    def load_state_dict(self, state):
        self.models = [self.put(v) for v in state["models"]]
        self.parent, self.created = list(state["parent"]), list(state["created"])
        self.split_at = list(state["split_at"])
        self.split_stats = [list(map(float, row)) for row in state["split_stats"]]
        self.directions = dict(zip(state["direction_nodes"], state["directions"]))
        self.node_of = np.array(state["node_of"], dtype=np.int64)
        self.last_ids = np.array(state["last_ids"], dtype=np.int64)
        self.last_alpha = np.array(state["last_alpha"], dtype=np.float64)


# ------------------------------------------------------------------------------------------- client

class CFLClient(ClientLogic):
    private_training = True  # client.fit; the server clusters the (private) trained models

    def step_train(self, client, msg, models):
        """Local training from the cluster's model (Sec. II, SGD_n(θ_c, D_i)); a working copy, as FedAvg's:
        a CFL client keeps no weights of its own."""
        model = client.scratch(models["cluster"])
        result = client.fit(model)
        trained = client.vector(model)
        return {"weights": trained, "trained": client.share(trained),  # averaged by the host; kept for the server
                "update_norm": update_norm(trained, models["cluster"]), **result}

    def eval_weights(self, msg, models):
        return models["cluster"]  # the client's cluster model (a split node's θ*_c while awaiting routing)


ALGORITHMS = [Algorithm("cfl", CFLParams, CFLServer, CFLClient,
                        "FedAvg per cluster, clusters bipartitioned by update similarity (Sattler et al. 2021)")]
