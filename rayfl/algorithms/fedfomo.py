"""FedFomo (Zhang et al., ICLR 2021, §3.1 and App. A): personalized FL by first-order model optimization.

The driver never averages. It keeps every client's latest upload as its own handle and the affinity matrix P
(K x K, identity at start, §3.1). Each round a participating client downloads the M-1 other models that
the top of its row of P picks (ε-greedy), adds its own latest model (M in all, as in the authors' code), weighs
each candidate θ_n against its *baseline* (its model from before its last local training: θ_i^{ℓ(t-1)} of
§3.1 and App. A.1) by the first-order weight

    w_n = (L_i(base) - L_i(θ_n)) / ||θ_n - base||                         (Eq. 3, L_i on the client's val split)

moves to base + Σ w*_n (θ_n - base) with w* = max(w, 0) / Σ max(w, 0)   (Eq. 13), or keeps base when no
w_n is positive ("early stopping"), then trains E local epochs and uploads. The raw (signed) w goes back to
the driver, which adds it to the client's row of P (p_i <- p_i + w, §3.1: the signed w, not w*).

Conventions (where the paper is silent, the authors' code decides):
- ε decays additively per round, ε_r = max(ε - r·decay, 0) (code; paper says only "0.05 decay each round").
- M counts the client's own model (code's num_update_clients + 1); the own model is never downloaded, the
  client has it in memory (it is exactly its last upload).
- The distance is the plain Euclidean norm by default (the paper's derivation); ``distance="l1"`` is the code's.
- A candidate at distance 0 from base gets w = 0 (its loss change is 0 too; avoids 0/0).
- The learning rate decays by ``lr_decay`` per round (paper A.6: 0.99), as lr·decay^r.
- After the last training round one more federated update, without local training, is made for every client
  and that model is evaluated (the code's "one more round of federated update"); ``final_update=False`` skips it.

Model-average variant (``baseline="average"``, Appendix A.4, Table 5's "Ours (MA)"): the reference point is the
simple average θ̄ of the client's N candidates (its M downloads, own model included) instead of its baseline, and

    w_n = (L_i(θ̄_{-n}) - L_i(θ̄)) / ||θ_n - θ̄||,   θ̄_{-n} = (1/(N-1)) Σ_{j≠n} θ_j          (Eq. 14)

with the sign changed with respect to Eq. 3: w_n > 0 when leaving θ_n out of the average raises the loss. The
paper writes Eq. 14 up to a factor and no update step; as in the authors' released code, the loss delta is
divided by the candidate's distance from θ̄, and the update is θ̄ + Σ w*_n (θ_n - θ̄) with Eq. 13's w*, so no
positive weight means θ̄. With one candidate there is no leave-one-out average: w = 0, the client takes θ̄ (that
candidate). The baseline φ_i of the single variant is still recorded but not read.

Differential privacy (Sec. 4 "Locally Private FedFomo"): local training goes through ``client.fit``, so
``dp_level=sample`` runs it as DP-SGD (rayfl.privacy); the weights read the validation split, which, as in the
paper, the guarantee does not cover.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfl.algorithms.base import Algorithm, ClientLogic, Matrix, Server, Stage
from rayfl.algorithms.common import weighted_mean

DISTANCES = ("l2", "l1")
BASELINES = ("single", "average")  # Eq. 3's single models against the own baseline | A.4's model averages


@dataclass
class FedFomoParams:
    M: int = 5  # models per client per round, own model included (paper: "5 clients downloaded")
    epsilon: float = 0.3  # ε-greedy exploration (paper A.6)
    epsilon_decay: float = 0.05  # subtracted from ε each round (paper A.6 "0.05 decay each round"; code: additive)
    distance: str = "l2"  # norm in Eq. 3's denominator: l2 (paper's derivation) or l1 (authors' code)
    lr_decay: float = 0.99  # learning rate multiplied by this every round (paper A.6)
    final_update: bool = True  # one more federated update after the last training round (authors' code)
    baseline: str = "single"  # single: Eq. 3 against the own baseline | average: Eq. 14's model averages (A.4)

    def check(self, n_clients: int) -> None:
        if n_clients < 2:  # Eq. 3 weighs the models of other clients: with one there is nothing to weigh
            raise ValueError(f"clients={n_clients}: FedFomo weighs other clients' models; it needs at least 2")
        if not 1 <= self.M <= n_clients:
            raise ValueError(f"M={self.M}: must be between 1 and the number of clients ({n_clients}), own model "
                             f"included")
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"epsilon={self.epsilon}: must be in [0, 1]")
        if self.epsilon_decay < 0:
            raise ValueError(f"epsilon_decay={self.epsilon_decay}: must be >= 0")
        if self.distance not in DISTANCES:
            raise ValueError(f"distance={self.distance!r}: allowed: {', '.join(DISTANCES)}")
        if not 0 < self.lr_decay <= 1:
            raise ValueError(f"lr_decay={self.lr_decay}: must be in (0, 1]")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline={self.baseline!r}: allowed: {', '.join(BASELINES)}")

    def check_config(self, cfg) -> None:
        if cfg.val_frac <= 0:
            raise ValueError(f"val_frac={cfg.val_frac}: FedFomo weighs models on each client's validation "
                             f"split, so it must be > 0")


# ------------------------------------------------------------------------------------------- the math

def epsilon_at(epsilon: float, decay: float, rnd: int) -> float:
    """ε_r = max(ε - r·decay, 0): the authors' additive reading of "0.05 decay each round" (App. A.6)."""
    return max(epsilon - decay * rnd, 0.0)


def select_models(p_row: np.ndarray, own: int, available: list[int], slots: int, eps: float,
                  rng: np.random.Generator) -> list[int]:
    """Up to ``slots`` other clients for one client: per slot, with probability ε the next model of a random
    permutation, else the next highest entry of p_i; duplicates skipped (§3.1; the per-slot draw is the authors'
    code). Ties in p are broken at random: P starts as the identity, so all others tie at first and the lowest
    ids would always win."""
    others = np.array([c for c in available if c != own], dtype=np.int64)
    if slots <= 0 or others.size == 0:
        return []
    greedy = list(others[np.lexsort((rng.random(others.size), -p_row[others]))])  # p descending, random ties
    explore = list(rng.permutation(others))
    chosen: list[int] = []
    while len(chosen) < min(slots, others.size):
        source = explore if rng.random() < eps else greedy
        while source[0] in chosen:
            source.pop(0)
        chosen.append(int(source.pop(0)))
    return chosen


def model_distance(a: np.ndarray, b: np.ndarray, kind: str = "l2") -> float:
    """||a - b|| over the flat parameter vector, in float64 (L1 norms of CNNs reach 1e5)."""
    d = a.astype(np.float64) - b.astype(np.float64)
    return float(np.abs(d).sum()) if kind == "l1" else float(np.sqrt(np.dot(d, d)))


def fomo_weights(base_loss: float, losses: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """Raw (signed) first-order weights, Eq. 3: w_n = (L(base) - L(θ_n)) / ||θ_n - base||; 0 at distance 0."""
    losses, distances = np.asarray(losses, np.float64), np.asarray(distances, np.float64)
    w = np.zeros_like(losses)
    moved = distances > 0
    w[moved] = (base_loss - losses[moved]) / distances[moved]
    return w


def fomo_weights_average(avg_loss: float, loo_losses: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """Raw (signed) weights of the model-average variant, Eq. 14 (Appendix A.4): w_n = (L(θ̄_{-n}) - L(θ̄)) /
    ||θ_n - θ̄||, positive when leaving θ_n out of the average raises the loss (Eq. 3's sign reversed); 0 at
    distance 0."""
    losses, distances = np.asarray(loo_losses, np.float64), np.asarray(distances, np.float64)
    w = np.zeros_like(losses)
    moved = distances > 0
    w[moved] = (losses[moved] - avg_loss) / distances[moved]
    return w


def leave_one_out(vecs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(θ̄, [θ̄_{-n} for each n]): the average of the candidates and each average without one (float64 sums)."""
    total = np.sum([v.astype(np.float64) for v in vecs], axis=0)
    n = len(vecs)
    loo = [((total - v) / (n - 1)).astype(np.float32) for v in vecs] if n > 1 else []
    return (total / n).astype(np.float32), loo


def normalize_weights(w: np.ndarray) -> np.ndarray:
    """w* = max(w, 0) / Σ max(w, 0) (Eq. 13); all zeros when no weight is positive (keep base, §3.1)."""
    clipped = np.maximum(np.asarray(w, np.float64), 0.0)
    total = clipped.sum()
    return clipped / total if total > 0 else clipped


def fomo_update(base: np.ndarray, candidates: list[np.ndarray], w_star: np.ndarray) -> np.ndarray:
    """θ_new = base + Σ_n w*_n (θ_n - base) (Eq. 3's update); base itself when Σ w* = 0 (early stopping)."""
    if not np.any(w_star > 0):
        return base.copy()
    out = base.astype(np.float64)
    for vec, wn in zip(candidates, w_star):
        if wn > 0:
            out += wn * (vec.astype(np.float64) - base)
    return out.astype(np.float32)


# ------------------------------------------------------------------------------------------- driver

class FedFomoServer(Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.info.n_clients
        self.uploads: dict[int, object] = {}  # cid -> handle of its latest upload, never averaged
        self.P = np.eye(k)  # affinity, p_{i,j}: how much client i wants client j's model (§3.1)
        self.W = np.full((k, k), np.nan)  # last normalized weights w* each client used (row = client; NaN: not
        self.W_raw = np.full((k, k), np.nan)  # downloaded) and the last raw weights w each client computed

    def stages(self):
        stages = [Stage("train", self.info.rounds)]
        if self.params.final_update:
            stages.append(Stage("update", 1, sample=False))  # federated update only, then the final evaluation
        return stages

    def plan(self, rnd: int, participants: list[int]) -> dict[int, dict]:
        """Each participant's downloads: M-1 other uploads picked from its row of P (its own it has)."""
        eps = epsilon_at(self.params.epsilon, self.params.epsilon_decay, rnd)
        available = sorted(self.uploads)
        messages = {}
        for c in participants:
            picked = select_models(self.P[c], c, available, self.params.M - 1, eps, self.rng)
            messages[c] = {"models": {"peers": {j: self.uploads[j] for j in picked}}, "round": rnd}
        return messages

    def run_round(self, stage, rnd, participants, call):
        # every message is planned from the uploads of earlier rounds, before any new one is stored: the
        # updates are simultaneous: no client sees a model uploaded in the same round
        messages = self.plan(rnd, participants)
        train = stage.name == "train"
        for m in messages.values():
            m["train"] = train
        ups = call("fomo", messages)
        kept = 0
        for c, up in ups.items():
            for j, wj in up["w"].items():
                self.P[c, j] += wj  # p_i <- p_i + w, raw w before clipping (§3.1)
            self.W_raw[c] = np.nan  # NaN: not a candidate of this client's last update
            self.W[c] = np.nan
            for j, wj in up["w"].items():
                self.W_raw[c, j] = wj
            for j, wj in up["w_star"].items():
                self.W[c, j] = wj
            kept += int(up["kept_base"])
            if train:
                self.uploads[c] = up["weights"]
        metrics = {"fedfomo_explore_rate": epsilon_at(self.params.epsilon, self.params.epsilon_decay, rnd),
                   "kept_base_frac": kept / max(len(ups), 1),
                   "downloads_mean": float(np.mean([len(m["models"]["peers"]) for m in messages.values()]))}
        if train:
            metrics["train_loss"] = weighted_mean(ups, "train_loss")
        return metrics

    def round_artifacts(self, rnd):
        return {"P": self.P.copy()}

    def artifacts(self):
        return {"P": self.P.copy(), "weights": self.W.copy(), "weights_raw": self.W_raw.copy()}

    client_ids = ("upload_ids",)

    def state_dict(self):
        cids = sorted(self.uploads)
        return {"P": self.P, "W": self.W, "W_raw": self.W_raw, "upload_ids": cids,
                "uploads": self.get([self.uploads[c] for c in cids])}

    def load_state_dict(self, state):
        self.P, self.W, self.W_raw = state["P"], state["W"], state["W_raw"]
        self.uploads = {c: self.put(v) for c, v in zip(state["upload_ids"], state["uploads"])}


# ------------------------------------------------------------------------------------------- client

class FedFomoClient(ClientLogic):
    private_training = True  # its training is client.fit (rayfl.privacy)

    def step_fomo(self, client, msg, models):
        """Federated update from the downloads (Eq. 3, 13), then (in training rounds) E local epochs."""
        trained = "base" in client.state
        base = client.state["base"] if trained else client.vector()  # θ_i^{l(t-1)}: start of last training
        candidates = dict(models.get("peers", {}))
        if trained:
            candidates[client.cid] = client.vector()  # own latest model ψ_i (= its upload), §3.1 / App. A.1
        ids = list(candidates)
        w = np.zeros(0)
        w_star = np.zeros(0)
        if ids:
            vecs = [candidates[j] for j in ids]
            if self.params.baseline == "average":  # Appendix A.4: the reference is the candidates' average
                base, loo = leave_one_out(vecs)
                losses = np.array([client.loss_of(v, "val") for v in loo]) if loo else np.zeros(0)
            else:
                losses = np.array([client.loss_of(v, "val") for v in vecs])
            base_loss = client.loss_of(base, "val")
            dists = np.array([model_distance(v, base, self.params.distance) for v in vecs])
            if self.params.baseline == "average":
                w = fomo_weights_average(base_loss, losses, dists) if loo else np.zeros(len(vecs))  # Eq. 14
            else:
                w = fomo_weights(base_loss, losses, dists)  # Eq. 3
            w_star = normalize_weights(w)  # Eq. 13
            client.load(fomo_update(base, vecs, w_star))
        else:
            client.load(base)
        kept = bool(ids) and not np.any(w_star > 0)  # no candidate beat the baseline: early stopping
        up = {"w": {j: float(x) for j, x in zip(ids, w)}, "w_star": {j: float(x) for j, x in zip(ids, w_star)},
              "kept_base": kept}
        if msg.get("train", True):
            client.state["base"] = client.vector()  # φ_i: the baseline of the next update (θ_i^{ℓ(t-1)}, §3.1)
            lr = client.settings.lr * self.params.lr_decay ** msg.get("round", 0)
            up.update(client.fit(lr=lr))
            up["weights"] = client.share(client.vector())
        return up


ALGORITHMS = [Algorithm(
    "fedfomo", FedFomoParams, FedFomoServer, FedFomoClient,
    "first-order weighted mix of M downloaded client models (Zhang et al. 2021)",
    # the final update-only round: a comparison also shows the run at its last training round
    compare_before={"update": "no-final-update"},
    plots={"P": Matrix("FedFomo affinity P: p_ij summed over rounds (row: client i, column: client j)",
                       "client j", "client i", diverging=True),
           "weights": Matrix("FedFomo weights w*_ij of the last update (row: client, column: downloaded model)",
                             "downloaded model (client id)", "client", diverging=False, missing="not downloaded"),
           "weights_raw": Matrix("FedFomo raw weights w_ij of the last update (row: client, column: downloaded model)",
                                 "downloaded model (client id)", "client", diverging=True, missing="not downloaded")})]
