"""FedProx: federated optimization in heterogeneous networks (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith,
MLSys 2020).

FedAvg whose clients minimize a proximal objective around the global model instead of their bare loss:

    h_k(w; w^t) = F_k(w) + μ/2 ||w − w^t||²                                                        (Eq. 2)
    ∇h_k(w; w^t) = ∇F_k(w) + μ (w − w^t)

Round t (Algorithm 2): the server sends w^t to the sampled devices; each device k finds w_k^{t+1}, an inexact
minimizer of h_k(·; w^t), and sends it back; the server averages them into w^{t+1}. μ = 0 is FedAvg; a larger μ
keeps each local model closer to w^t.

Choices, where the paper leaves room:
- The local solver: the run's ``local_epochs`` of minibatch SGD on h_k (the run's lr, batch size, momentum and
  weight decay; with ``optimizer=adam``, Adam on the same gradient), i.e. FedAvg's local work with the proximal gradient μ(w − w^t) added to every minibatch
  gradient, as the authors' PerturbedGradientDescent does (w ← w − η(∇F_k(w) + μ(w − w^t))). The paper's
  γ_k^t-inexactness (a per-device, per-round amount of local work) and its stragglers (in its systems-heterogeneity
  experiments, devices that do fewer epochs: the code's ``drop_percent``) are not modelled: every sampled client
  does the run's epochs, so FedProx and FedAvg differ by the proximal term only.
- Sampling and averaging: Algorithm 2 samples devices with probability p_k and takes the plain mean; the paper's
  experiments (§5.1) and its code sample uniformly and average weighted by local training-set size, as FedAvg
  (McMahan et al. 2017) does. That is done here: FedAvg's server, unchanged, and the loop's uniform sampling.
- The proximal term covers the trainable parameters (the code's trainable variables), not buffers; w^t is a copy
  taken before the first local step (anchoring to the live weights would make the term vanish: FedAvg).
- Evaluated like FedAvg: the global model w^t on every client's val and test splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rayfl import training
from rayfl.algorithms.base import Algorithm
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer


@dataclass
class FedProxParams:
    # μ of Eq. 2. 1: the paper's tuned μ for Synthetic, MNIST and FEMNIST (0.001 Shakespeare, 0.01 Sent140), the
    # value its synthetic-data runs (Fig. 2) use; the authors advise tuning μ over {0.001, 0.01, 0.1, 0.5, 1}
    mu: float = 1.0

    def check(self, n_clients: int) -> None:
        if not (0 <= self.mu < math.inf):  # NaN fails both comparisons
            raise ValueError(f"mu={self.mu}: must be a finite number >= 0 (0 is FedAvg)")


# ------------------------------------------------------------------------------------------- the math

def add_proximal_gradient(grad: torch.Tensor, w: torch.Tensor, w_global: torch.Tensor, mu: float,
                          trainable: torch.Tensor | None = None) -> torch.Tensor:
    """∇h_k = ∇F_k(w) + μ (w − w^t) (Eq. 2), in place on ``grad`` (flat tensors); ``trainable`` (a 0/1 mask,
    or None for all) keeps the term off the entries that are not trainable parameters."""
    diff = w - w_global
    if trainable is not None:
        diff.mul_(trainable)
    return grad.add_(diff, alpha=mu)


class ProximalOptimizer:
    """The local solver of Algorithm 2 (w_k^{t+1} ≈ argmin_w h_k(w; w^t)): ``inner`` (the run's optimizer)
    stepping on h_k(·; w^t) instead of F_k, with w^t the model's weights when this is made.

    On a flat model trained with :class:`rayfl.training.FlatSGD` the proximal gradient is one fused update of the
    flat gradient buffer; other optimizers (Adam, models that cannot be flattened) get it per parameter tensor
    through torch's foreach kernels."""

    def __init__(self, inner, model: torch.nn.Module, mu: float):
        self.inner, self.mu = inner, float(mu)
        if isinstance(inner, training.FlatSGD):
            self.params = None
            self.anchor = inner.flat.detach().clone()  # w^t
            self.trainable = trainable_mask(model)
        else:
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.anchor = [p.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        if self.params is None:
            add_proximal_gradient(self.inner.grad, self.inner.flat, self.anchor, self.mu, self.trainable)
        else:
            pairs = [(p, a) for p, a in zip(self.params, self.anchor) if p.grad is not None]
            if pairs:
                diff = torch._foreach_sub([p for p, _ in pairs], [a for _, a in pairs])
                torch._foreach_add_([p.grad for p, _ in pairs], diff, alpha=self.mu)
        self.inner.step()


def trainable_mask(model: torch.nn.Module) -> torch.Tensor | None:
    """A 0/1 float mask over the flat weight vector, 1 on the entries of trainable parameters; None when every
    entry is one (rayfl's models have no buffers)."""
    parts, dense = [], True
    for t in model.state_dict(keep_vars=True).values():  # the flat vector's layout (training.to_vector)
        if not t.is_floating_point():
            continue
        is_param = isinstance(t, torch.nn.Parameter) and t.requires_grad
        dense &= is_param
        parts.append(torch.full((t.numel(),), float(is_param), device=t.device))
    return None if dense else torch.cat(parts)


# ------------------------------------------------------------------------------------------- the algorithm

class FedProxClient(FedAvgClient):
    private_training = True  # client.fit; the proximal term is added to the (private) gradient after it
    local_buffers = True  # loads through client.scratch, trains through client.fit

    def local_fit(self, client, model, msg):
        """Algorithm 2, device side: from w^t (``model``), the run's epochs of SGD on h_k(·; w^t)."""
        s = client.settings
        inner = training.optimizer_for(model, s.optimizer, s.lr, s.momentum, s.weight_decay)
        return client.fit(model, optimizer=ProximalOptimizer(inner, model, self.params.mu))


ALGORITHMS = [
    Algorithm("fedprox", FedProxParams, FedAvgServer, FedProxClient,
              "FedAvg with the proximal term mu/2 ||w - w_global||^2 in each local objective (Li et al. 2020)"),
]
