"""User-centric federated learning (Mestoukirdi et al., 2021, arXiv 2110.09869, §III).

One special round before training (``Server.setup``): every user uploads its full-batch mean gradient g_i at
the common model θ̂ (the shared initialisation), its gradient variance σ_i² (eq. 7) and its data size n_i.
The driver computes, once, the row-stochastic collaboration matrix

    w_ij = softmax_j( log n_j - ||g_i - g_j||² / (2 σ_i σ_j) )                                 (eq. 6)

and, for k < m downlink streams, runs k-means on the rows of W; every cluster gets one model built from its
centroid's weights (§III-B). Each round every user trains from its stream's model and the driver forms
θ_c = Σ_j ŵ_cj θ_j^{t-1/2} over all users' uploaded parameters (eq. 5). k = m (or 0) is full
personalization, and identical users (Δ = 0) give w_ij = n_j / Σn: FedAvg.

Choices where the paper is silent (§III-A gives neither θ̂ nor the σ² batches), written down here:
- θ̂ is the common initial model; W and the clustering are computed once and never again.
- σ² batches: n_k = ``sigma_batch`` (0: the run's batch size), K = floor(n_i / n_k) contiguous batches of the
  (already shuffled) training split, remainder dropped; n_k is capped at n_i / 2 for users with fewer than
  2 n_k samples so that K >= 2. σ is floored at 1e-12 so a user with one sample becomes "local only", not a NaN.
  n_k sets how sharp W is (σ² of a batch-mean gradient shrinks like 1/n_k). Measured at θ̂ on MNIST-t10k,
  20 users in 4 rotation groups, seed 0, from training gradients only (no evaluation): W's mass on the user
  itself / same-group others / other groups is .07/.26/.67 at n_k = 32 (a usual batch), .32/.51/.17 at 128
  and .37/.51/.12 at 512 (k-means on W finds the 4 groups at every n_k); with S2's Dirichlet(0.4) label shift
  on top it is .05/.20/.75 at n_k = 1, .09/.20/.70 at 8, .43/.17/.39 at 32 and .99/.01/.00 at 128 (W = I:
  local training). Under label shift no n_k gives W the rotation groups (same-group others hold about their
  4/19 share; the gradients differ by the users' label mixes, not their rotations). On validation (the S2
  preset, 3 seeds, 10 rounds, benchmarks/results_compare.md) the run's batch size beat n_k = 8 at k = 4 and
  k = m, so it stays the default; ``sigma_batch`` is swept in tune_spaces/usercentric.yaml.
- Gradients are over all trainable parameters, of the mean-reduced loss, in float64.
- Every user takes part in every round (the paper sums over all j): the stage does not sample, so the run's
  ``participation`` is not used. The optimizer is fresh each round (momentum reset: the paper does not
  say, and a buffer kept across rounds would carry steps taken before the driver replaced the model).
- k-means: sklearn KMeans, k-means++ init, n_init=10, seeded; centroids renormalised to sum 1 (harmless).
- Silhouette scores of k-means on the rows of W are logged for k = 2 .. min(m - 1, 10) (the paper's guide for
  choosing k, §III-B); they are reported, not used to pick k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rayfl import training
from rayfl.algorithms.base import Algorithm, ClientLogic, Matrix, Server, Stage
from rayfl.algorithms.common import weighted_mean

if TYPE_CHECKING:
    import pandas as pd

SIGMA_FLOOR = 1e-12
SILHOUETTE_MAX_K = 10


@dataclass
class UserCentricParams:
    streams: int = 0  # k downlink streams; 0 or the number of users: full personalization (k = m)
    sigma_batch: int = 0  # n_k of eq. (7); 0: the run's batch size (the paper gives no n_k)

    def check(self, n_clients: int) -> None:
        if not 0 <= self.streams <= n_clients:
            raise ValueError(f"streams={self.streams}: must be in [0, clients={n_clients}] (0 means one per user)")
        if self.sigma_batch < 0:
            raise ValueError(f"sigma_batch={self.sigma_batch}: must be >= 0 (0 means the run's batch size)")


# --------------------------------------------------------------------------------------------- the math

def collaboration_weights(grads: np.ndarray, sigma2: np.ndarray, n: np.ndarray) -> np.ndarray:
    """W (m x m, rows sum to 1) from the users' mean gradients (m x d), variances σ² and sizes n (eq. 6).

    Log-space softmax: the n_i of the paper's ratio n_j / n_i cancels (eq. 6)."""
    from scipy.spatial.distance import cdist

    g = np.asarray(grads, dtype=np.float64)
    delta = cdist(g, g, "sqeuclidean")  # Δ_ij = ||g_i - g_j||², pairwise differences: no cancellation
    s = np.sqrt(np.maximum(np.asarray(sigma2, dtype=np.float64), SIGMA_FLOOR))  # σ: standard deviations
    logits = np.log(np.asarray(n, dtype=np.float64))[None, :] - delta / (2.0 * s[:, None] * s[None, :])
    logits -= logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(axis=1, keepdims=True)


def assign_streams(w: np.ndarray, streams: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(stream of each user, stream weights k x m): k-means on the rows of W, centroids as weights (§III-B).

    streams = 0 or m: every user is its own stream with its own row of W (eq. 5)."""
    m = w.shape[0]
    if streams in (0, m):
        return np.arange(m), w.copy()
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=streams, n_init=10, random_state=seed).fit(w)
    centroids = np.clip(km.cluster_centers_, 0.0, None)
    return km.labels_.astype(np.int64), centroids / centroids.sum(axis=1, keepdims=True)


def silhouette_scores(w: np.ndarray, seed: int, max_k: int = SILHOUETTE_MAX_K) -> dict[int, float]:
    """Silhouette score of k-means on the rows of W for each k in 2 .. min(m - 1, max_k)."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    out = {}
    distinct = len(np.unique(w.round(12), axis=0))  # identical users: fewer distinct points than k
    for k in range(2, min(w.shape[0] - 1, distinct, max_k) + 1):
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(w)
        out[k] = float(silhouette_score(w, labels)) if len(set(labels)) > 1 else float("nan")
    return out


def aggregate(weights: np.ndarray, vectors: list[np.ndarray]) -> np.ndarray:
    """θ_c = Σ_j ŵ_cj θ_j for every stream c (eq. 5): parameters, not deltas, of all users; float64 sums."""
    out = np.zeros((weights.shape[0], vectors[0].size), dtype=np.float64)
    for j, v in enumerate(vectors):  # one pass over the uploads: each model read once
        out += np.outer(weights[:, j], v)
    return out.astype(np.float32)


def gradient_stats(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, batch: int,
                   chunk: int = 1024) -> tuple[np.ndarray, float]:
    """(g_i, σ_i²): the full-batch mean gradient and eq. (7)'s mini-batch variance around it."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.eval()

    def mean_grad(xb, yb):
        grads = torch.autograd.grad(loss_fn(model(xb), yb), params)  # mean-reduced loss: (1/n) Σ ∇ℓ
        return torch.cat([t.reshape(-1) for t in grads]).double()

    n = x.shape[0]
    g = sum(mean_grad(x[s:s + chunk], y[s:s + chunk]) * (min(chunk, n - s) / n) for s in range(0, n, chunk))
    b = max(1, min(batch, n // 2))
    k = n // b
    if n < 2:
        return g.float().cpu().numpy(), 0.0
    dev = [float((mean_grad(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) - g).pow(2).sum()) for i in range(k)]
    return g.float().cpu().numpy(), float(np.mean(dev))  # eq. (7)


# --------------------------------------------------------------------------------------------- driver

class UserCentricServer(Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.w: np.ndarray | None = None
        self.labels: np.ndarray | None = None
        self.centroids: np.ndarray | None = None
        self.stream_refs: list = []
        self.stats: pd.DataFrame | None = None
        self.silhouette: dict[int, float] = {}

    def stages(self):
        return [Stage("train", self.info.rounds, sample=False)]  # all m users every round (eq. 5 sums over all j)

    def setup(self, call):
        """The special round: gradient statistics at θ̂, then W, the streams and the silhouette scores."""
        m = self.info.n_clients
        ups = call("stats", {c: {"models": {"theta": self.initial}} for c in range(m)})
        cids = sorted(ups)
        grads = np.stack(self.get([ups[c]["grad"] for c in cids]))
        sigma2 = np.array([ups[c]["sigma2"] for c in cids])
        n = np.array([ups[c]["n"] for c in cids], dtype=np.float64)
        self.w = collaboration_weights(grads, sigma2, n)
        self.labels, self.centroids = assign_streams(self.w, self.params.streams, self.info.seed)
        self.stream_refs = [self.initial] * self.centroids.shape[0]  # every stream starts at θ^0
        self.silhouette = silhouette_scores(self.w, self.info.seed)
        import pandas as pd

        self.stats = pd.DataFrame({"client": cids, "stream": self.labels, "n": n, "sigma2": sigma2,
                                   "group": self.info.groups if self.info.groups else [None] * m})
        metrics = {"streams": float(self.centroids.shape[0]), "w_self_mean": float(np.diag(self.w).mean()),
                   "sigma2_mean": float(sigma2.mean()), **{f"silhouette_k{k}": v for k, v in self.silhouette.items()}}
        if self.silhouette:
            metrics["silhouette_best_k"] = float(max(self.silhouette, key=lambda k: self.silhouette[k]))
        if self.info.groups is not None:
            from sklearn.metrics import adjusted_rand_score

            metrics["streams_ari_groups"] = float(adjusted_rand_score(self.info.groups, self.labels))
        return metrics

    def run_round(self, stage, rnd, participants, call):
        ups = call("train", {c: {"models": {"start": self.stream_refs[self.labels[c]]}} for c in participants})
        cids = sorted(ups)
        weights = self.centroids[:, cids]
        weights = weights / weights.sum(axis=1, keepdims=True)  # a no-op while every user takes part
        new = aggregate(weights, self.get([ups[c]["weights"] for c in cids]))
        self.stream_refs = [self.put(v) for v in new]
        return {"train_loss": weighted_mean(ups, "train_loss")}

    def eval_messages(self, stage, rnd, cids):
        return {c: {"models": {"personal": self.stream_refs[self.labels[c]]}} for c in cids}

    def artifacts(self):
        import pandas as pd

        out = {"W": self.w, "streams": self.stats,
               "silhouette": pd.DataFrame({"k": list(self.silhouette), "silhouette": list(self.silhouette.values())})}
        if self.centroids.shape[0] < self.info.n_clients:
            out["stream_weights"] = self.centroids
        return out

    def state_dict(self):
        return {"w": self.w, "labels": self.labels, "centroids": self.centroids, "stats": self.stats,
                "silhouette": self.silhouette, "streams": self.get(self.stream_refs)}

    def load_state_dict(self, state):
        self.w, self.labels, self.centroids = state["w"], state["labels"], state["centroids"]
        self.stats, self.silhouette = state["stats"], state["silhouette"]
        self.stream_refs = [self.put(v) for v in state["streams"]]


# --------------------------------------------------------------------------------------------- client

class UserCentricClient(ClientLogic):
    # rayfl.privacy: local training goes through client.fit, but the setup round does not
    private_training = ("its setup round uploads each user's full-batch mean gradient and gradient variance on its "
                        "training data (eq. 6-7) unnoised, which DP-SGD does not cover")

    def step_stats(self, client, msg, models):
        """g_i and σ_i² at θ̂ on the training split, and n_i (the special round)."""
        model = client.new_model(models["theta"])
        x, y = client.splits["train"]
        batch = self.params.sigma_batch or client.settings.batch_size
        g, sigma2 = gradient_stats(model, x, y, training.loss_fn_for(client.settings.task), batch)
        return {"grad": client.share(g), "sigma2": sigma2, "n": client.n()}

    def step_train(self, client, msg, models):
        client.load(models["start"])  # θ_c(i)^{t-1}: the user's own stream, not a global model
        result = client.fit()  # θ_i^{t-1/2}
        return {"weights": client.share(client.vector()), **result}

    def step_evaluate(self, client, msg, models):
        if "personal" in models:
            client.load(models["personal"])
        return client.evaluate(client.model)


ALGORITHMS = [
    Algorithm("usercentric", UserCentricParams, UserCentricServer, UserCentricClient,
              "user-centric aggregation with softmax weights from gradient statistics, k downlink streams",
              work="FedAvg's, plus one gradient-statistics pass before the first round (Mestoukirdi et al., "
                   "Sec. III)",
              plots={"W": Matrix("User-centric aggregation weights w_ij (row: user, column: user whose update is "
                                 "mixed)", "user j (update)", "user i", diverging=False)}),
]
