"""pFedMe (T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

The bi-level problem: min_w F(w) = (1/N) Σ_i F_i(w), with the Moreau envelope
F_i(w) = min_θ { f_i(θ) + λ/2 ||θ − w||² }; its minimiser θ̂_i(w) is client i's personalized model, w the global one.

Algorithm 1. Every round t the server sends w_t to the clients; each sets w_{i,0} = w_t and runs R local rounds:

    sample a batch D_i;
    θ̃_i ≈ argmin_θ h_i(θ) = f_i(θ; D_i) + λ/2 ||θ − w_{i,r}||²          (Eq. 7, :func:`solve_inner`), by K steps
          θ ← θ − ν (∇f_i(θ; D_i) + λ (θ − w_{i,r}))                    at the personal learning rate ν
    w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ̃_i)                             (local update, :func:`local_update`)

then the server samples S clients, which send w_{i,R}, and moves the global model by β:

    w_{t+1} = (1 − β) w_t + β (1/S) Σ_{i∈S^t} w_{i,R}                      (global update, :func:`global_update`)

η is the run's ``lr`` (the paper's learning rate). What is evaluated is each client's personalized model θ_i, the
last θ̃_i it computed (the paper's "personalized model", pFedMe (PM)); the paper's global-model accuracy (pFedMe
(GM)) is logged beside it as the extra split ``global_model`` (``global_model_acc_mean``, ...).

Choices where the paper is silent (and what the authors' code does), written down:
- R, the local rounds: ``R`` = 0 (default) means the run's local work, one local round per minibatch of
  ``local_epochs`` passes over the training split, R = local_epochs × ⌈n_i / batch_size⌉, each round on the next
  batch of a stream of random permutations (``client.gen``): FedAvg's data budget, with K gradient evaluations a
  batch instead of one. The paper (and its code) fix R = 20 batches of |D| = 20 whatever n_i: ``R=20`` with
  ``batch_size=20``.
- Every client runs its local rounds every round, sampled or not, and only the sampled ones upload: Algorithm 1
  as written (and the code), so every personalized model follows the current global model; the price is N/S times
  FedAvg's local work. ``train_all=False`` trains only the sampled clients (FedAvg's budget); the others keep the
  θ_i of the last round they took part in.
- The inner solve starts from w_t at a round's first local round and from the previous θ̃_i after that (warm
  start, as the code does).
- The server's mean over the sampled clients is a plain mean (Algorithm 1; the code weighs it by training-set size).
- θ_i is what is scored: the authors' code keeps θ̃_i in the very parameters it then overwrites with w_{i,R}, so
  its "personalized" accuracy is w_{i,R}'s; the paper's personalized model is θ̃_i.
- No extra L2 term in the inner solve (the code adds μ θ with μ = 0.001 to the inner gradient; the paper has none).
- The inner and local steps are the paper's plain gradient steps: momentum, weight decay and Adam are refused.
- The inner solve is checked (Sec. 3 asks for a δ-approximate θ̃_i, ||∇h_i(θ̃_i)|| small): at each round's last
  local round the client measures ||∇h_i|| where the K steps started and at θ̃_i (one more gradient) and uploads
  both; the round logs their mean at θ̃_i (``inner_grad_norm``) and the clients whose θ̃_i is no nearer the
  minimiser than where it started (``inner_unsettled``), and the first such round warns, naming ν. Gradient
  descent on h_i (λ-strongly convex near its minimiser, λ + L smooth) overshoots once ν (λ + L) > 2: with the
  defaults ν λ = 1.35 already, so a client whose loss is steep (two classes, a sharp minimum) can see θ̃_i swing
  between its classes from one round to the next. The paper's comparison ran with these values, so they stay
  the defaults; the warning says when a run is in that regime.
- Defaults: λ = 15, K = 5, ν = 0.09, β = 1: the paper's MNIST comparison with the same hyperparameters for every
  algorithm (non-convex DNN, η = 0.005, |D| = 20, R = 20, S = 5 of N = 20), the values the FedFomo and PersFL
  papers' pFedMe baselines ran with. Table 1's tuned MNIST values are λ = 15, ν = 0.1, β = 2, η = 0.01 (MLR) and λ = 30, ν = 0.05, β = 2, η = 0.01
  (DNN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rayfl import training
from rayfl.algorithms.base import Algorithm, ClientLogic, Server
from rayfl.algorithms.common import (UNIFORM, Batches, batches_per_epoch, gradient, plain_steps, to_tensor, weighted_mean,
                                     with_global_model)


@dataclass
class PFedMeParams:
    lam: float = 15.0  # λ, the Moreau envelope's regularisation (paper's MNIST comparison)
    K: int = 5  # gradient steps of the inner solve (paper's experiments: K = 5)
    personal_lr: float = 0.09  # ν, the inner solve's step size (paper's non-convex MNIST comparison)
    beta: float = 1.0  # β, the global update's step (paper's comparison; Table 1 tunes it to 2)
    R: int = 0  # local rounds per round; 0: local_epochs × ⌈n_i / batch_size⌉ (the paper: 20)
    train_all: bool = True  # Algorithm 1: every client runs its local rounds, the sampled ones upload

    def check(self, n_clients: int) -> None:
        for name in ("lam", "personal_lr", "beta"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value}: must be a finite number > 0")
        if self.K < 1:
            raise ValueError(f"K={self.K}: must be >= 1")
        if self.R < 0:
            raise ValueError(f"R={self.R}: must be >= 0 (0: local_epochs x batches per epoch)")

    def check_config(self, cfg) -> None:
        plain_steps(cfg, "pFedMe takes the paper's plain gradient steps (Algorithm 1; eta is the run's lr)")


# ------------------------------------------------------------------------------------------- the math

def inner_step(theta: torch.Tensor, grad: torch.Tensor, pull: torch.Tensor, nu: float, lam: float) -> torch.Tensor:
    """θ ← θ − ν ∇h_i(θ), with ∇h_i(θ) = ∇f_i(θ; D) + λ (θ − w) the gradient of Eq. 7's objective; computed as
    (1 − νλ) θ + νλ w − ν ∇f_i(θ; D), in place, with ``pull`` = νλ w made once per solve (w is fixed during
    it): two passes over θ instead of four."""
    torch.add(pull, theta, alpha=1.0 - nu * lam, out=theta)
    return theta.add_(grad, alpha=-nu)


def inner_gradient_norm(grad: torch.Tensor, theta: torch.Tensor, w: torch.Tensor, lam: float) -> float:
    """||∇h_i(θ)|| = ||∇f_i(θ; D) + λ (θ − w)||, the gradient norm of Eq. 7's objective at θ."""
    return float(torch.linalg.vector_norm((grad + lam * (theta - w)).double()))


def solve_inner(model: nn.Module, theta: torch.Tensor, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                p: PFedMeParams, loss_fn, measure: bool = False):
    """θ̃ ≈ argmin_θ f_i(θ; D) + λ/2 ||θ − w||² (Eq. 7) by K gradient steps of size ν from ``theta``, all on
    the same batch D, in place in ``theta`` (which may be the model's own flat weights: nothing is copied);
    returns θ̃ and f_i(θ̃; D). ``measure``: also ||∇h_i|| where the solve started and at θ̃ (one more
    gradient), the check that θ̃ is the δ-approximate minimiser Algorithm 1 asks for (Sec. 3: ||∇h_i(θ̃)||
    small); when the second is not below the first, the K steps of size ν did not approach it."""
    pull = w * (p.personal_lr * p.lam)
    start = None
    for _ in range(p.K):
        _, grad = gradient(model, theta, x, y, loss_fn, keep=False)
        with torch.no_grad():
            if measure and start is None:
                start = inner_gradient_norm(grad, theta, w, p.lam)
            inner_step(theta, grad, pull, p.personal_lr, p.lam)
    if measure:
        _, grad = gradient(model, theta, x, y, loss_fn, keep=False)
        end = inner_gradient_norm(grad, theta, w, p.lam)
    with torch.no_grad():
        training.load_vector(model, theta)
        loss = loss_fn(model(x), y)
    return (theta, loss, start, end) if measure else (theta, loss)


def unsettled_warning(p: PFedMeParams, unsettled: int, trained: int) -> str:
    """The caveat when the inner solve moved away from its minimiser on some clients: ν·λ near or above 2
    makes gradient descent on h_i (at least λ-smooth) overshoot, and θ̃_i, the model each client is scored
    on, then swings from one batch to the next."""
    return (f"pfedme: the inner solve did not settle on {unsettled} of {trained} clients (||grad h_i|| at the "
            f"returned theta not below where it started: no delta-approximate minimiser, T. Dinh et al. 2020, "
            f"Sec. 3); personal_lr={p.personal_lr:g} with lam={p.lam:g} (nu*lam = {p.personal_lr * p.lam:.2f}) "
            f"overshoots: lower personal_lr")


def local_update(w: torch.Tensor, theta: torch.Tensor, eta: float, lam: float) -> torch.Tensor:
    """w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ̃_i) (Algorithm 1's local update)."""
    return torch.add(w, w - theta, alpha=-eta * lam)


def global_update(w: np.ndarray, mean_local: np.ndarray, beta: float) -> np.ndarray:
    """w_{t+1} = (1 − β) w_t + β (1/S) Σ_{i∈S^t} w_{i,R} (Algorithm 1's global update), in float64."""
    w64 = np.asarray(w, dtype=np.float64)
    return ((1 - beta) * w64 + beta * np.asarray(mean_local, dtype=np.float64)).astype(np.float32)


def local_rounds(n: int, batch_size: int, epochs: int, R: int) -> int:
    """R: the knob, else epochs × ⌈n / batch_size⌉ (one local round per minibatch); 0 for an empty split."""
    if n == 0:
        return 0
    return R or epochs * batches_per_epoch(n, batch_size)


# ------------------------------------------------------------------------------------------- driver

class PFedMeServer(Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.w = np.array(self.get([self.initial])[0], dtype=np.float32)  # the global model w_t
        self.global_ref = self.initial
        self.pending, self.warned = [], False  # the inner solve's caveat, said once a run

    def run_round(self, stage, rnd, participants, call):
        """All clients (``train_all``) or the sampled ones run R local rounds from w_t; the sampled upload."""
        chosen = set(participants)
        sampled = {"models": {"global": self.global_ref}, "upload": True}  # two messages, each sent to many
        others = {"models": {"global": self.global_ref}, "upload": False}
        targets = range(self.info.n_clients) if self.params.train_all else participants
        ups = call("train", {c: sampled if c in chosen else others for c in targets}, reduce=UNIFORM)
        self.w = global_update(self.w, ups.reduced["weights"], self.params.beta)
        self.global_ref = self.put(self.w)
        checked = [u for u in ups.values() if "inner_grad_end" in u]
        unsettled = sum(u["inner_grad_end"] >= u["inner_grad_start"] for u in checked)
        if unsettled and not self.warned:
            self.pending.append(unsettled_warning(self.params, unsettled, len(checked)))
            self.warned = True
        return {"train_loss": weighted_mean({c: ups[c] for c in participants}, "train_loss"),
                "local_rounds_mean": float(np.mean([u["rounds"] for u in ups.values()])),
                "trained_clients": len(ups),
                "inner_grad_norm": float(np.mean([u["inner_grad_end"] for u in checked])) if checked else math.nan,
                "inner_unsettled": float(unsettled)}

    def warnings(self):
        out, self.pending = self.pending, []
        return out

    def eval_messages(self, stage, rnd, cids):
        return dict.fromkeys(cids, {"models": {"global": self.global_ref}})

    def final_model(self):
        return self.global_ref

    def state_dict(self):
        return {"global": self.w.copy()}

    def load_state_dict(self, state):
        self.w = np.array(state["global"], dtype=np.float32)
        self.global_ref = self.put(self.w)


# ------------------------------------------------------------------------------------------- client

class PFedMeClient(ClientLogic):
    private_training = "its K inner steps on each batch do not go through the private path"

    def step_train(self, client, msg, models):
        """R local rounds (Algorithm 1) from w_t; keeps the last θ̃_i as the client's personalized model and
        uploads w_{i,R} when sampled."""
        p, s = self.params, client.settings
        x, y = client.splits["train"]
        w = to_tensor(models["global"], client.device)
        model = client.scratch(w)
        # θ is the working model's own weights when they are all parameters (a forward pass would move buffers)
        own = training.flat_weights(model) if not len(training.buffer_index(model)) else None
        theta = w.clone() if own is None else own
        batches = Batches(x, y, s.batch_size, client.gen)
        loss_fn = training.loss_fn_for(s.task)
        rounds = local_rounds(int(x.shape[0]), s.batch_size, s.local_epochs, p.R)
        total = torch.zeros((), dtype=torch.float64, device=w.device)
        check = {}
        for r in range(rounds):
            xb, yb = batches.next()
            if r == rounds - 1:  # the θ̃_i the client keeps: is it near the minimiser of its h_i?
                theta, loss, start, end = solve_inner(model, theta, w, xb, yb, p, loss_fn, measure=True)
                check = {"inner_grad_start": start, "inner_grad_end": end}
            else:
                theta, loss = solve_inner(model, theta, w, xb, yb, p, loss_fn)
            w = local_update(w, theta, s.lr, p.lam)
            total += loss
        if rounds:
            client.load(theta)  # θ_i: what the client is evaluated on
        up = {"rounds": rounds, "n": int(x.shape[0]), "train_loss": float(total) / rounds if rounds else float("nan"),
              **check}
        if msg["upload"]:
            up.update(weights=w.cpu().numpy(), one=1)
        return up

    def step_evaluate(self, client, msg, models):
        """θ_i on val/test (pFedMe (PM)); the global model w_t on test as ``global_model`` (pFedMe (GM))."""
        return with_global_model(client.evaluate(client.model), client, models["global"])


ALGORITHMS = [Algorithm("pfedme", PFedMeParams, PFedMeServer, PFedMeClient,
                        "Moreau-envelope personalization, bi-level local updates (T. Dinh et al. 2020); "
                        "the paper's personal_lr=0.09 with lam=15 can overshoot the inner solve on steep "
                        "clients: the run warns when it does",
                        work="FedAvg's batches, K inner steps on each; every client trains each round, the sampled "
                             "ones upload (T. Dinh et al. 2020, Alg. 1; train_all=False: only those)")]
