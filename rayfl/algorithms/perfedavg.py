"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020): FedAvg on the MAML objective.

The problem is min_w F(w) = (1/n) Σ_i F_i(w) with F_i(w) = f_i(w − α ∇f_i(w)): a global model that is good
*after* one gradient step on a client's own data. Its gradient is ∇F_i(w) = (I − α ∇²f_i(w)) ∇f_i(w − α ∇f_i(w)).

Algorithm 1. The server sends w_k to the sampled clients A_k; each sets w = w_k and takes τ local steps, each
with three independent batches D, D', D'' of its training split:

    w̃ = w − α ∇f_i(w, D)                                        (inner step, :func:`inner_step`)
    w ← w − β (I − α ∇²f_i(w, D'')) ∇f_i(w̃, D')                  (outer step)

approximated as the paper's two variants:

    FO:  w ← w − β ∇f_i(w̃, D')                                   (Hessian term dropped, :func:`fo_step`)
    HF:  w ← w − β (g − α d),  g = ∇f_i(w̃, D'),                  (:func:`hf_step`)
         d = [∇f_i(w + δ g, D'') − ∇f_i(w − δ g, D'')] / (2δ) ≈ ∇²f_i(w, D'') g   (:func:`hessian_vector_product`)

and the server averages what comes back, w_{k+1} = (1/|A_k|) Σ_{i∈A_k} w^i (Algorithm 1's last line: a plain
mean, :data:`UNIFORM`; the pFedMe authors' re-implementation weighs by training-set size, the paper does not).

Evaluation: a client's personalized model is the global model after one stochastic gradient step of size α on
its own data, θ_i = w − α ∇f_i(w, D_eval) (Sec. 5: every model compared is updated by one stochastic gradient
step at test time); the global model is what is trained and averaged, the clients keep no weights of their own.

Choices where the paper is silent, written down:
- D_eval is drawn from the client's **training** split only, never validation or test. Sec. 5 does not say
  which data the test-time step reads; the pFedMe authors' re-implementation steps on test batches, a leak. It is one batch of the run's ``batch_size`` (the whole split
  when it is smaller), drawn with a generator seeded by (run seed, client, round), so that evaluation consumes
  none of the client's random streams and leaves it exactly as it was.
- D, D', D'' are consecutive batches of the run's ``batch_size`` from a stream of random permutations of the
  training split (``client.gen``; a new permutation when one is used up, as the authors' loader restarts),
  so the batches of one step are disjoint. τ (``tau``) = 0 means the run's local work: ``local_epochs`` passes
  over the split, i.e. τ = local_epochs × max(1, ⌊⌈n_i/batch_size⌉ / b⌋) with b = 2 batches a step (FO) or 3
  (HF); the paper's experiments use a fixed τ = 10.
- α and β are this algorithm's own step sizes, the knobs ``inner_lr`` and ``outer_lr`` (``alpha`` names the
  Dirichlet partition's concentration in a run's config): the run's ``lr``, optimizer, momentum and weight decay
  are not used (plain gradient steps, Algorithm 1), and a config that sets momentum, weight decay or Adam is
  refused.
- The finite difference is the plain central difference with the paper's δ (no scaling by ||g||).
- Defaults: α = β = δ = 0.001, the paper's experiments (Sec. 5, MNIST and CIFAR-10; it also reports α = 0.01).
- The pFedMe authors' re-implementation (github.com/CharlieDinh/pFedMe, users/userperavg.py), which the FedFomo
  and PersFL papers ran Per-FedAvg with, counts its ``local_epochs`` as meta-steps of two batches each: a run of
  that code with ``--local_epochs 20`` is ``tau=20`` here. Its FO step is this one since its March 2021 fix;
  before it, the β step was taken from w̃ instead of w (two plain SGD steps).
- Beside the personalized record, each client reports the un-adapted global model on its test split as the
  extra split ``global_model`` (``global_model_acc_mean``, ...): the "no update" column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from rayfl import training
from rayfl.algorithms.base import Algorithm, ClientLogic
from rayfl.algorithms.baselines import FedAvgServer
from rayfl.algorithms.common import (UNIFORM, Batches, batches_per_epoch, gradient, plain_steps, to_tensor, weighted_mean,
                                     with_global_model)

VARIANTS = ("fo", "hf")  # fo: Per-FedAvg (FO); hf: Per-FedAvg (HF)
BATCHES_PER_STEP = {"fo": 2, "hf": 3}  # D, D' (and D'') per local step


@dataclass
class PerFedAvgParams:
    inner_lr: float = 0.001  # α: inner (adaptation) step size, also the evaluation's step (Sec. 5)
    outer_lr: float = 0.001  # β: outer (meta) step size (Sec. 5)
    variant: str = "fo"  # fo: first-order, Hessian dropped; hf: Hessian-free finite difference
    delta: float = 0.001  # δ of the HF finite difference (Sec. 5); unused by fo
    tau: int = 0  # local steps a round; 0: the run's local_epochs passes over the training split (see above)

    def check(self, n_clients: int) -> None:
        for name in ("inner_lr", "outer_lr", "delta"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value}: must be a finite number > 0")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}: allowed: {', '.join(VARIANTS)}")
        if self.tau < 0:
            raise ValueError(f"tau={self.tau}: must be >= 0 (0: the run's local_epochs passes)")

    def check_config(self, cfg) -> None:
        plain_steps(cfg, "Per-FedAvg takes plain gradient steps of sizes inner_lr and outer_lr (Algorithm 1)")


# ------------------------------------------------------------------------------------------- gradients

def local_steps(n: int, batch_size: int, epochs: int, variant: str, tau: int) -> int:
    """τ: the knob, else epochs × max(1, ⌊batches per epoch / batches per step⌋) (0 for an empty split)."""
    if n == 0:
        return 0
    return tau or epochs * max(1, batches_per_epoch(n, batch_size) // BATCHES_PER_STEP[variant])


# ------------------------------------------------------------------------------------------- the math

def inner_step(w: torch.Tensor, grad: torch.Tensor, alpha: float) -> torch.Tensor:
    """w̃ = w − α ∇f_i(w, D) (Algorithm 1's inner step; also the evaluation's one-step adaptation)."""
    return torch.add(w, grad, alpha=-alpha)  # one fused pass


def fo_step(w: torch.Tensor, grad_tilde: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-FedAvg (FO): w − β ∇f_i(w̃, D'), the outer step with the Hessian term dropped."""
    return torch.add(w, grad_tilde, alpha=-beta)


def hessian_vector_product(grad_at: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, v: torch.Tensor,
                           delta: float) -> torch.Tensor:
    """Per-FedAvg (HF): ∇²f_i(w, D'') v ≈ [∇f_i(w + δv, D'') − ∇f_i(w − δv, D'')] / (2δ)."""
    return (grad_at(w + delta * v) - grad_at(w - delta * v)) / (2 * delta)


def hf_step(w: torch.Tensor, grad_tilde: torch.Tensor, hv: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Per-FedAvg (HF): w − β (∇f_i(w̃, D') − α d), d ≈ ∇²f_i(w, D'') ∇f_i(w̃, D'): the outer step's
    (I − α ∇²f_i) ∇f_i with the Hessian-vector product approximated."""
    return torch.add(w, torch.add(grad_tilde, hv, alpha=-alpha), alpha=-beta)


def meta_step(model: nn.Module, w: torch.Tensor, batches: Batches, p: PerFedAvgParams,
              loss_fn: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """One local step of Algorithm 1 from w, on the stream's next batches D, D' (and D'' for HF); returns the
    new w and f_i(w̃, D'), the meta-objective's sample."""
    _, grad = gradient(model, w, *batches.next(), loss_fn)  # ∇f_i(w, D)
    w_tilde = inner_step(w, grad, p.inner_lr)
    loss, grad_tilde = gradient(model, w_tilde, *batches.next(), loss_fn)  # ∇f_i(w̃, D')
    if p.variant == "fo":
        return fo_step(w, grad_tilde, p.outer_lr), loss
    x2, y2 = batches.next()  # D''
    hv = hessian_vector_product(lambda v: gradient(model, v, x2, y2, loss_fn)[1], w, grad_tilde, p.delta)
    return hf_step(w, grad_tilde, hv, p.inner_lr, p.outer_lr), loss


# ------------------------------------------------------------------------------------------- evaluation

def eval_generator(seed: int, cid: int, rnd: int) -> torch.Generator:
    """The evaluation's batch draw: from (run seed, client, round) only, never from the client's streams."""
    state = np.random.SeedSequence([seed, cid, rnd, 0xE7A1]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]))


def adaptation_batch(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """D_eval: ``batch_size`` samples of the training split drawn without replacement (all of a smaller one)."""
    if x.shape[0] <= batch_size:
        return x, y
    idx = torch.randperm(x.shape[0], generator=gen)[:batch_size].to(x.device)
    return x[idx], y[idx]


# ------------------------------------------------------------------------------------------- driver

class PerFedAvgServer(FedAvgServer):
    """FedAvg's global model, state and final model; the round is Algorithm 1's, the average a plain mean."""

    def run_round(self, stage, rnd, participants, call):
        ups = call("train", dict.fromkeys(participants, {"models": {"global": self.global_ref}}), reduce=UNIFORM)
        self.global_ref = self.put(ups.reduced["weights"])
        return {"train_loss": weighted_mean(ups, "train_loss"),
                "local_steps_mean": float(np.mean([u["steps"] for u in ups.values()]))}

    def eval_messages(self, stage, rnd, cids):
        # one message for every client: each derives its own adaptation batch from (seed, its id, round)
        return dict.fromkeys(cids, {"models": {"global": self.global_ref}, "seed": self.info.seed, "round": rnd})


# ------------------------------------------------------------------------------------------- client

class PerFedAvgClient(ClientLogic):
    private_training = "its meta-gradient steps (two or three batches each) do not go through the private path"

    def step_train(self, client, msg, models):
        """τ local steps of Algorithm 1 from the global model on a working copy; uploads the result."""
        p, s = self.params, client.settings
        x, y = client.splits["train"]
        model = client.scratch(models["global"])
        w = to_tensor(models["global"], client.device)
        batches = Batches(x, y, s.batch_size, client.gen)
        loss_fn = training.loss_fn_for(s.task)
        steps = local_steps(int(x.shape[0]), s.batch_size, s.local_epochs, p.variant, p.tau)
        total = torch.zeros((), dtype=torch.float64, device=w.device)
        for _ in range(steps):
            w, loss = meta_step(model, w, batches, p, loss_fn)
            total += loss
        return {"weights": w.cpu().numpy(), "one": 1, "steps": steps, "n": int(x.shape[0]),
                "train_loss": float(total) / steps if steps else float("nan")}

    def personalize(self, client, msg, models) -> torch.Tensor:
        """θ_i = w − α ∇f_i(w, D_eval), D_eval from the client's training split (see the module docstring)."""
        s = client.settings
        w = to_tensor(models["global"], client.device)
        x, y = client.splits["train"]
        if x.shape[0] == 0:
            return w
        xb, yb = adaptation_batch(x, y, s.batch_size, eval_generator(int(msg["seed"]), client.cid, int(msg["round"])))
        _, grad = gradient(client.scratch(w), w, xb, yb, training.loss_fn_for(s.task))
        return inner_step(w, grad, self.params.inner_lr)

    def step_evaluate(self, client, msg, models):
        """The personalized model on val/test; the un-adapted global model on test as ``global_model``."""
        record = client.evaluate(client.scratch(self.personalize(client, msg, models)))
        return with_global_model(record, client, models["global"])


ALGORITHMS = [Algorithm("perfedavg", PerFedAvgParams, PerFedAvgServer, PerFedAvgClient,
                        "FedAvg on the MAML objective, one-step personalization (Fallah et al. 2020)",
                        work="FedAvg's batches, two (FO) or three (HF) to a local step (Fallah et al. 2020, Alg. 1)")]
