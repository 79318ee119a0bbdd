"""MOCHA (Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017): clients as tasks,
one model w_t per client, the tasks coupled through a learned task-relationship matrix.

The objective (Eq. 1 with the regularizer of Eq. 2), W = [w_1 ... w_m] one column per client:

    min_{W, Ω}  Σ_t (1/n_t) Σ_i ℓ(w_tᵀ x_t^i, y_t^i) + R(W, Ω),   R(W, Ω) = λ1 tr(W Ω Wᵀ) + λ2 ||W||²_F

solved by alternating (Algorithm 1): rounds that update W with Ω fixed, then Ω in closed form from W, centrally
(W is all it needs; Algorithm 1 line 11). For the task-relationship formulation, which the paper takes from
Zhang & Yeung (2010):

    Σ = (WᵀW)^{1/2} / tr((WᵀW)^{1/2}),   Ω = Σ⁻¹                                          (Ω-step)

Zhang & Yeung regularize with tr(W Σ⁻¹ Wᵀ) over {Σ ⪰ 0, tr Σ = 1}, and the closed form is that problem's
minimizer: Σ is the task covariance (trace 1, symmetric positive definite) and, in Eq. 2's notation where Ω
multiplies W directly, Ω = Σ⁻¹ (the task precision). Taking the closed form itself as Ω would make the Ω-step
no minimization of Eq. 1 at all (the minimizer of tr(W Ω Wᵀ) over that set puts all of Ω's mass on one
eigenvector of WᵀW). The authors' code computes Σ by the closed form and regularizes with its inverse, as we do,
and starts from Σ = I/m (Ω = m·I), as we do.

How it is applied to a neural network, and why: MOCHA's tasks are linear models on fixed features. Here the
task-specific part w_t is the model's *last layer* (its weight matrix and bias, flattened: for C classes the
C per-class linear models of one task share Ω), and the layers below it (the body) are one shared feature map,
FedAvg-trained (averaged weighted by training-set size, as FedPer does with one personal layer). The coupling
tr(W Ω Wᵀ) compares heads coordinate by coordinate, which means something only if every head reads the same
features; with a shared body they do, and with a one-layer model (``logreg``, ``sine-mlp``) there is no body
and this is MOCHA's own problem. Each client's local objective is its mean loss plus R as a function of its own
head, whose gradient 2λ1 (Ω_tt w_t + c_t) + 2λ2 w_t needs only c_t = Σ_{s≠t} Ω_ts w_s (:func:`couplings`):
the server sends c_t and Ω_tt. With the body changing every round, the sum over clients of the body's
loss is what FedAvg minimizes (the weights n_t / Σn make it Σ_t Σ_i ℓ up to a constant), so a round is one
alternating step on the same objective: clients train (body + own head under R), the server averages the body,
gathers the heads into W and, every ``omega_every`` rounds, updates Ω.

The W-update is primal SGD, not the paper's dual method: MOCHA's CoCoA-style solver works on the dual of a
convex loss of fixed features (Section 3, w(α) = ∇R*(Xα)), and neither holds for a network whose body moves
each round. The paper's own primal baseline (mini-batch SGD, Section 5) is SGD on the same objective. Every client
does the run's local work (``local_epochs``, ``batch_size``, ``lr``, as FedAvg): a step on the batch loss,
then the exact proximal step of R in the head (:func:`prox_head`, forward-backward splitting: R is quadratic in
the head, so the step moves it a fixed fraction of the way to R's own minimizer). The proximal step equals the
explicit gradient step to first order in the learning rate, but it is stable for any λ1·Ω_tt, while an explicit
step diverges once lr·(λ1 Ω_tt + λ2) > 1: Ω = Σ⁻¹ reaches Ω_tt ~ 10⁵ when the heads are nearly collinear (Σ's
eigenvalues are floored, below), which the dual method handles by its scaling σ'.

Choices where the paper is silent, with what the authors' public (MATLAB) code does:
- Per-task losses are means over the task's samples, as in the code's primal objective (mean hinge loss per
  task); the paper's Eq. 1 sums, which only rescales λ1, λ2 per task by n_t.
- λ2 defaults to 0: the code omits the ||W||²_F term (its authors: it made no significant difference, and
  equals Ω + (λ2/λ1)·I). The code writes (λ/2)·tr(WΩWᵀ), so its λ = 1e-4 (optimization driver) is λ1 = 5e-5.
- Ω's schedule: the code's prediction experiments run 10 outer iterations of 100 W-rounds each, Ω updated after
  each outer iteration. ``omega_every = 0`` keeps those 10 updates per run (every ⌊rounds / 10⌋ rounds, at
  least every round); a positive value is the number of rounds between updates (the code's 100).
- Before the square root, WᵀW's eigenvalues below 1e-7 are raised to 1e-7, as in the code (which does so when
  some eigenvalue is negative, what a rank-deficient WᵀW computed in floating point almost always has); no ε·I
  is added. We floor always, which differs only for an eigenvalue in (0, 1e-7), where the code's inverse is as
  ill-conditioned. Σ comes from WᵀW's eigendecomposition and Ω from Σ's, in float64.
- Heads start at the common initial model's last layer (the code starts W at 0; rayfl starts every algorithm
  from one initial model). A client that has not trained yet keeps that head in W.
- The personalized model a client is evaluated with is the current shared body with its own head. The run keeps
  the shared body as its final model and the heads as an artifact (the body's own last layer, an average of
  heads, is never read).
- The proximal step's step size is the run's lr, also under ``optimizer=adam``.
- The server logs R(W, Ω) each round; Ω and Σ are server artifacts (``omega``, ``task_covariance``: m x m,
  plotted as heatmaps). Σ and Ω are m x m and the update is O(m³): fine for the papers' 15-100 clients.

Others' "MOCHA": FedFomo's MOCHA rows (Zhang et al. 2021) were run with LG-FedAvg's (Liang et al. 2020) released
MTL baseline: every client's whole network is local, the top layer(s) are coupled by a fixed Ω (never updated,
and built from a matrix of ones, not the identity, so it penalizes the heads' sum) with a 10^-digits(d) scale.
PFLlib's FedMTL builds W from detached copies, so its regularizer has no gradient at all (its author: "FedMTL is
not MOCHA"). Another reimplementation (Liu et al. 2022, JAX) regularizes with Σ itself rather than Σ⁻¹.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rayfl import training
from rayfl.algorithms.base import Algorithm, ClientLogic, Server
from rayfl.algorithms.common import weighted_mean
from rayfl.algorithms.layers import layer_slices
from rayfl.reduce import WeightedMean

EIG_FLOOR = 1e-7  # WᵀW's eigenvalues are raised to this before the square root (authors' code)
OUTER_ITERS = 10  # Ω updates per run when omega_every = 0 (the code's mocha_outer_iters in its model driver)


@dataclass
class MochaParams:
    lam1: float = 5e-5  # λ1 of Eq. 2 (on tr(WΩWᵀ)): the code's λ/2·tr(WΩWᵀ), λ = 1e-4 (optimization driver)
    lam2: float = 0.0  # λ2 of Eq. 2 (on ||W||²_F); 0 as in the authors' code, which leaves the term out
    omega_every: int = 0  # rounds between Ω updates (Alg. 1's H); 0: ⌊rounds / 10⌋, the code's 10 outer iterations

    def check(self, n_clients: int) -> None:
        for name in ("lam1", "lam2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value}: must be a finite number >= 0")
        if self.omega_every < 0:
            raise ValueError(f"omega_every={self.omega_every}: must be >= 0 (0: every rounds/10 rounds)")


# ------------------------------------------------------------------------------------------- the math

def task_covariance(W: np.ndarray, floor: float = EIG_FLOOR) -> np.ndarray:
    """Σ = (WᵀW)^{1/2} / tr((WᵀW)^{1/2}) (Alg. 1 line 11; Zhang & Yeung 2010), WᵀW's eigenvalues floored at
    ``floor`` (authors' code). W: d x m, one column per task; returns m x m, symmetric, trace 1."""
    W = np.asarray(W, dtype=np.float64)
    evals, vecs = np.linalg.eigh(W.T @ W)
    roots = np.sqrt(np.maximum(evals, floor))
    sigma = (vecs * (roots / roots.sum())) @ vecs.T
    return (sigma + sigma.T) / 2


def precision(sigma: np.ndarray) -> np.ndarray:
    """Ω = Σ⁻¹, the matrix inside R (Eq. 2), symmetric (from Σ's eigendecomposition)."""
    evals, vecs = np.linalg.eigh(np.asarray(sigma, dtype=np.float64))
    omega = (vecs / evals) @ vecs.T
    return (omega + omega.T) / 2


def couplings(W: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """c_t = Σ_{s≠t} Ω_ts w_s for every task t (column t of the d x m result): with Ω_tt, all that the gradient
    of tr(WΩWᵀ) in w_t, 2 (Ω_tt w_t + c_t), needs of the other tasks."""
    W = np.asarray(W, dtype=np.float64)
    return W @ omega - W * np.diag(omega)


def regularizer(W: np.ndarray, omega: np.ndarray, lam1: float, lam2: float) -> float:
    """R(W, Ω) = λ1 tr(W Ω Wᵀ) + λ2 ||W||²_F (Eq. 2)."""
    W = np.asarray(W, dtype=np.float64)
    return float(lam1 * np.sum((W @ omega) * W) + lam2 * np.sum(W * W))  # tr(WΩWᵀ) without the d x d product


def head_target(c: torch.Tensor, omega_tt: float, lam1: float, lam2: float) -> torch.Tensor | None:
    """argmin_w r(w), r(w) = λ1 (Ω_tt ||w||² + 2 wᵀc) + λ2 ||w||² (R as a function of one head, Eq. 2):
    w* = -λ1 c / (λ1 Ω_tt + λ2), the head its coupled neighbours pull it to; None when R does not act on it."""
    curvature = lam1 * omega_tt + lam2
    return None if curvature == 0 else c * (-lam1 / curvature)


def prox_weight(omega_tt: float, lam1: float, lam2: float, lr: float) -> float:
    """κ = 2 lr (λ1 Ω_tt + λ2) / (1 + 2 lr (λ1 Ω_tt + λ2)): how far the proximal step moves a head to w*."""
    k = 2 * lr * (lam1 * omega_tt + lam2)
    return k / (1 + k)


def prox_head(v: torch.Tensor, c: torch.Tensor, omega_tt: float, lam1: float, lam2: float,
              lr: float) -> torch.Tensor:
    """argmin_w r(w) + ||w - v||² / (2 lr) = (v - 2 lr λ1 c) / (1 + 2 lr (λ1 Ω_tt + λ2)): for a quadratic r, the
    point κ of the way from v to r's minimizer w* (:func:`head_target`, :func:`prox_weight`)."""
    target = head_target(c, omega_tt, lam1, lam2)
    return v.clone() if target is None else torch.lerp(v, target, prox_weight(omega_tt, lam1, lam2, lr))


class ProxHead:
    """An optimizer: the run's step on the batch loss, then :func:`prox_head` on the head's entries (w* and κ made
    once: they hold for the round)."""

    def __init__(self, inner, head: list[torch.Tensor], coupling: torch.Tensor, omega_tt: float, lam1: float,
                 lam2: float, lr: float):
        self.inner = inner
        target = head_target(coupling, omega_tt, lam1, lam2)
        self.weight = prox_weight(omega_tt, lam1, lam2, lr)
        self.pairs, offset = [], 0  # each head tensor with its part of w*
        for t in head if target is not None else ():
            self.pairs.append((t, target[offset:offset + t.numel()].view_as(t)))
            offset += t.numel()

    def zero_grad(self, *args, **kwargs) -> None:
        self.inner.zero_grad(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for t, target in self.pairs:
            t.lerp_(target, self.weight)


def head_range(model) -> slice:
    """The last layer's entries in the flat weight vector (rayfl.algorithms.layers)."""
    return layer_slices(model)[-1][1]


def head_tensors(model, head: slice) -> list[torch.Tensor]:
    """The model's tensors that hold the entries of ``head`` (the last layer: the tail of the vector), as views of
    the parameters' storage: one slice of a flattened model's weight vector (one proximal step a batch)."""
    flat = training.flat_weights(model)
    if flat is not None:
        return [flat[head]]
    out, offset = [], 0
    for t in model.state_dict().values():
        if t.is_floating_point():
            if offset >= head.start:
                out.append(t)
            offset += t.numel()
    return out


def set_head(model, head: slice, values: torch.Tensor):
    """``model`` with its head's entries set to ``values`` (a client's head, flat): the shared body loaded into
    a model, this client's own head put on it."""
    offset = 0
    with torch.no_grad():
        for t in head_tensors(model, head):
            t.copy_(values[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return model


# ------------------------------------------------------------------------------------------- driver

class MochaServer(Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        m = self.info.n_clients
        self.global_ref = self.initial  # the shared body (its head entries: unused)
        self.W = None  # d_head x m, every client's latest head (from setup on)
        self.sigma = np.eye(m) / m  # Σ_0 = I/m (authors' code)
        self.omega = np.eye(m) * m  # Ω_0 = Σ_0⁻¹

    def setup(self, call):
        """A client says where the last layer lies (the server has no model); every head starts as the common
        initial model's."""
        up = call("locate", {0: {}})[0]
        h0 = np.asarray(self.get([self.initial])[0], dtype=np.float64)[up["start"]:up["stop"]]
        self.W = np.repeat(h0[:, None], self.info.n_clients, axis=1)
        return {}

    def period(self) -> int:
        return self.params.omega_every or max(1, self.info.rounds // OUTER_ITERS)

    def run_round(self, stage, rnd, participants, call):
        C = couplings(self.W, self.omega)
        messages = {c: {"models": {"global": self.global_ref}, "coupling": C[:, c].astype(np.float32),
                        "omega_tt": float(self.omega[c, c])} for c in participants}
        ups = call("train", messages, reduce=WeightedMean("weights", by="n"))  # Alg. 1 lines 6-10
        self.global_ref = self.put(ups.reduced["weights"])  # the body: FedAvg
        for c, up in ups.items():
            self.W[:, c] = up["head"]  # the heads: gathered, never averaged
        metrics = {"train_loss": weighted_mean(ups, "train_loss")}
        updated = (rnd + 1) % self.period() == 0
        if updated:  # Alg. 1 line 11
            self.sigma = task_covariance(self.W)
            self.omega = precision(self.sigma)
        metrics["omega_updated"] = float(updated)
        metrics["regularizer"] = regularizer(self.W, self.omega, self.params.lam1, self.params.lam2)
        return metrics

    def eval_messages(self, stage, rnd, cids):
        return dict.fromkeys(cids, {"models": {"global": self.global_ref}})

    def final_model(self):
        return self.global_ref

    def artifacts(self):
        """Ω and Σ; and every client's head, one row each: client c's personalized model is the final model
        (the shared body) with its last layer's entries replaced by row c."""
        return {"omega": self.omega.copy(), "task_covariance": self.sigma.copy(), "heads": self.W.T.copy()}

    def state_dict(self):
        return {"global": self.get([self.global_ref])[0], "W": self.W, "sigma": self.sigma, "omega": self.omega}

    def load_state_dict(self, state):
        self.global_ref = self.put(state["global"])
        self.W = state["W"]
        self.sigma, self.omega = state["sigma"], state["omega"]


# ------------------------------------------------------------------------------------------- client

class MochaClient(ClientLogic):
    """A client keeps its head alone (``client.state["head"]``): the body it trains and is evaluated on is the
    shared one of the round, so its head is all that is its own, and all that its snapshots hold."""

    # sample-level DP (rayfl.privacy): training is client.fit, DP-SGD on the data gradient; the proximal head step
    # then only post-processes it with the server's c_t and Ω_tt, themselves made from the clients' released heads
    private_training = True

    def step_locate(self, client, msg, models):
        s = head_range(client.scratch(client.initial))
        return {"start": s.start, "stop": s.stop}

    def own_head(self, client, head: slice) -> torch.Tensor:
        """Its head: the one it trained last, or the common initial model's last layer before it has trained."""
        if "head" in client.state:
            return torch.as_tensor(client.state["head"], device=client.device)
        return client.initial[head]

    def personal_model(self, client, models):
        """The shared body with this client's own head: a working copy, the client's state untouched."""
        model = client.scratch(models["global"])
        head = head_range(model)
        return set_head(model, head, self.own_head(client, head)), head

    def step_train(self, client, msg, models):
        """Shared body + own head; the run's local epochs on the mean loss, with R's proximal step on the head."""
        p, s = self.params, client.settings
        model, head = self.personal_model(client, models)
        coupling = torch.as_tensor(np.asarray(msg["coupling"], dtype=np.float32), device=client.device)
        inner = training.optimizer_for(model, s.optimizer, s.lr, s.momentum, s.weight_decay)
        opt = ProxHead(inner, head_tensors(model, head), coupling, float(msg["omega_tt"]), p.lam1, p.lam2, s.lr)
        result = client.fit(model, optimizer=opt)
        vec = client.vector(model)
        client.state["head"] = vec[head].copy()
        return {"weights": vec, "head": client.state["head"], **result}

    def step_evaluate(self, client, msg, models):
        """The shared body with the client's own head (its personalized model); the client is left as it was."""
        return client.evaluate(self.personal_model(client, models)[0])


ALGORITHMS = [Algorithm("mocha", MochaParams, MochaServer, MochaClient,
                        "multi-task FL: shared body, heads coupled by a learned Ω (Smith et al. 2017)")]
