"""FedeRiCo ("Find Your Friends", Sui et al., 2022, §3): decentralized EM over collaborators, no averaging.

Every client i owns a model φ_i, a table L̂_i of EMA losses of every client's model on its own data, and
weights w_i = softmax(-L̂_i) (the EM posterior p(z_i = j | D_i)). A round is two phases, both peer to peer
through the object store; the driver only routes handles, it never averages or reads a model:

1. ``estep`` on every participant i, at Φ^(t-1): fetch φ_j for its M neighbours N_i (chosen ε-greedily at
   the end of the previous round), evaluate own and neighbour models on one local minibatch, update the EMA
   losses of those entries only (§3.3, "E-step"), recompute w_i, and compute for each j ∈ N_i ∪ {i} the
   gradient of w_ij · loss(φ_j; B_i) (scaled by n_i / n̄, see below). Gradients for neighbours go out as
   handles keyed by owner; the own term stays home. Then pick N_i for the next round from the NEW w_i.
2. ``mstep`` on every participant j (owner): sum its own term and the gradients routed to it, i.e.
   Σ_i w_ij ∇φ_j loss(φ_j; D_i) — the COLUMN j of W, not the row (Eq. 8) — and take one optimizer step.

A round repeats the two phases ``local_steps`` times (each repetition is one iteration of the paper's
algorithm: one E-step and one optimizer step per client), then evaluates. The paper runs 150 such iterations;
``local_steps=0`` (default) gives each round as many steps as a baseline's local training makes,
local_epochs x ceil(n_i / batch_size) averaged over clients, so that FedeRiCo and FedAvg / Local compare
at the same number of optimizer steps per round (``local_steps=1`` is one paper iteration per round).

Prediction of client i is the w_i-weighted mixture of the models' OUTPUTS (probabilities for
classification, values for regression; §3.2, after Eq. 6), not the own model alone.

Choices where the paper is silent (each also marked [CHOICE] where it is made):
- independent initialisation of every φ_i, seeded per client;
- L̂ starts from one all-to-all evaluation on the full train split at t = 0 (``init_losses="all"``: an entry
  left at 0 would look like the best client), or at the client's own initial loss for every entry (``"own"``:
  no communication);
- the per-round loss is the MEAN loss per sample on one minibatch of ``cfg.batch_size`` (Eq. 3's sum over
  n_i samples would make w one-hot at once); the same batch gives the E-step loss and the M-step gradient.
  ``loss_sum=True`` takes Eq. 3 literally (n_i x the batch mean): a 1/n_i lower softmax temperature;
- Eq. 8 sums per-sample gradients over n_i points: the mean-loss gradient is scaled by n_i / n̄ (n̄ the
  mean train size), i.e. Eq. 8 divided by the constant n̄, absorbed into η like the 1/n of Eq. 4;
- ε-greedy is one coin per client per round (§3.3 also reads as a coin per slot), ties in the greedy top-M
  broken at random;
- the optimizer is the run's (``cfg.optimizer``, ``cfg.lr``); the paper's setting is ``adam`` at 0.01;
- a gradient addressed to an owner that is not taking part in the round (participation < 1) is dropped;
- prediction leaves out collaborators with w_ij < PRED_MIN_WEIGHT and renormalizes (the paper: the others
  have weight "(almost) 0", so each client needs only a few models for prediction).

Differential privacy (``dp_level=sample``, rayfl.privacy) [CHOICE]: what leaves a client and depends on its
training split must be DP-SGD's. The gradients g_{j<-i} of one iteration are one Gaussian mechanism: on a Poisson
sample of the training split, each sample's gradients for all of N_i ∪ {i} together are clipped to norm C, the
sums get N(0, σ²C²) noise, and only then are they weighted by w_ij · n_i/n̄ (post-processing); one accountant
step per iteration. The E-step's losses (and so w_i, N_i, the initial L̂ and the logged loss) are computed on the
client's validation split instead, which the guarantee does not cover (as FedFomo's weights in Zhang et al. 2021,
Sec. 4); DP therefore needs ``val_frac`` > 0.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from rayfl import privacy, training
from rayfl.algorithms.base import Algorithm, ClientLogic, Matrix, Server

PRED_MIN_WEIGHT = 1e-4  # collaborators below this weight are left out of the prediction mixture
INIT_LOSSES = ("all", "own")


@dataclass
class Params:
    epsilon: float = 0.3  # probability of sampling neighbours uniformly instead of greedily (paper: 0.3)
    M: int = 3  # neighbours sampled per client per round (paper: 3)
    beta: float = 0.6  # EMA weight on the NEW loss: L̂ <- (1-β) L̂ + β l (§3.3; paper: 0.6, §4.1)
    init_losses: str = "all"  # initial L̂: "all" (one all-to-all evaluation at t=0) or "own" (own loss)
    loss_sum: bool = False  # per-round loss as Eq. 3's SUM over the n_i samples (n_i x batch mean), not the mean
    local_steps: int = 0  # E/M iterations per round; 0: a baseline's minibatch steps (local_epochs x n_i/batch)

    def check(self, n_clients: int) -> None:
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon={self.epsilon}: must be in [0, 1]")
        if not 0 <= self.M <= n_clients - 1:
            raise ValueError(f"M={self.M}: must be in [0, clients-1] = [0, {n_clients - 1}] (never itself)")
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta={self.beta}: must be in [0, 1) (the weight on the new loss)")
        if self.local_steps < 0:
            raise ValueError(f"local_steps={self.local_steps}: must be an integer >= 0 (0: the baselines' "
                             f"minibatch steps per round)")
        if self.init_losses not in INIT_LOSSES:
            raise ValueError(f"init_losses={self.init_losses!r}: allowed: {', '.join(INIT_LOSSES)}")

    def check_config(self, cfg) -> None:
        if cfg.dp_noise > 0 and cfg.dp_level == "sample" and cfg.val_frac <= 0:
            raise ValueError(f"val_frac={cfg.val_frac}: under dp_level=sample FedeRiCo's E-step reads the validation "
                             "split (the training split is DP-SGD's only), so it must be > 0")


# --------------------------------------------------------------------------------------- the math, pure

def ema_update(L: np.ndarray, idx, losses, beta: float) -> np.ndarray:
    """L̂_ij <- (1-β) L̂_ij + β l_ij for the evaluated entries only; the others stay stale (§3.3, "E-step")."""
    out = np.array(L, dtype=np.float64)
    idx = np.asarray(idx, dtype=np.int64)
    out[idx] = (1.0 - beta) * out[idx] + beta * np.asarray(losses, dtype=np.float64)
    return out


def posterior(L: np.ndarray) -> np.ndarray:
    """w_i = softmax(-L̂_i), with max-subtraction (§3.3, "Tracking the losses"; Eq. 3 with the prior folded
    into L̂)."""
    z = -np.asarray(L, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def eps_greedy(w: np.ndarray, me: int, M: int, eps: float, rng: np.random.Generator) -> list[int]:
    """M distinct neighbours, never ``me``: with probability ε uniform, else the top-M of w (§3.3, "Sampling
    scheme").

    [CHOICE] one coin per round, not one per slot; ties in the top-M are broken at random so that a uniform
    w (e.g. identical losses) does not always favour low client ids."""
    others = np.delete(np.arange(len(w)), me)
    if M <= 0:
        return []
    if rng.random() < eps:
        picked = rng.choice(others, size=M, replace=False)
    else:
        order = np.lexsort((rng.random(len(others)), -np.asarray(w)[others]))  # highest w first
        picked = others[order[:M]]
    return sorted(int(j) for j in picked)


class Mixture(nn.Module):
    """h_i(x) = Σ_j w_ij h_φj(x) (§3.2, after Eq. 6); for classification a mixture of probabilities,
    returned as log-probabilities so that cross-entropy and argmax in ``training.evaluate`` stay right."""

    def __init__(self, models: list[nn.Module], weights, task: str):
        super().__init__()
        self.members = nn.ModuleList(models)
        first = next(itertools.chain(models[0].parameters(), models[0].buffers()), None)
        device = first.device if first is not None else None  # the members' (a client's GPU): w meets their outputs
        w = torch.as_tensor(np.asarray(weights, dtype=np.float32), device=device)
        self.register_buffer("w", w / w.sum())
        self.task = task

    def forward(self, x):
        outs = [m(x) for m in self.members]
        if self.task == "regression":
            return sum(wj * o for wj, o in zip(self.w, outs))
        logp = torch.stack([F.log_softmax(o, dim=1) for o in outs])  # (J, B, C)
        return torch.logsumexp(logp + self.w.log().view(-1, 1, 1), dim=0)  # log Σ_j w_j p_j(y|x)


# --------------------------------------------------------------------------------------------- driver

class FedericoServer(Server):
    """Routes model and gradient handles between clients and keeps W (one row per client) for logging."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        K = self.info.n_clients
        self.models: dict[int, object] = {}  # latest model handle per owner
        self.next: dict[int, list[int]] = {i: [] for i in range(K)}  # N_i for the coming round
        self.W = np.full((K, K), 1.0 / K)
        self.n_mean = float(np.mean(self.info.n_train)) if self.info.n_train else 1.0
        self.steps = self.params.local_steps

    def setup(self, call):
        K = self.info.n_clients
        ups = call("share", {i: {} for i in range(K)})  # every φ_i has its own initialisation
        self.models = {i: u["model"] for i, u in ups.items()}
        everyone = self.params.init_losses == "all"
        msgs = {i: {"K": K, "n_mean": self.n_mean,
                    "models": {"peers": {j: self.models[j] for j in range(K) if j != i and everyone}}}
                for i in range(K)}
        ups = call("init", msgs)
        self._absorb_rows(ups)
        if not self.steps:  # a baseline's minibatch steps per round, averaged over clients
            self.steps = max(1, int(round(np.mean([u["steps"] for u in ups.values()]))))
        return {"local_steps": float(self.steps)}

    def run_round(self, stage, rnd, participants, call):
        losses, received = [], []
        for _ in range(self.steps):
            ups, inbox = self.iteration(participants, call)
            losses.append(np.mean([u["loss"] for u in ups.values()]))
            received.append(np.mean([len(v) for v in inbox.values()]))
        return {"train_loss": float(np.mean(losses)), "grads_received_mean": float(np.mean(received)),
                **self.weight_metrics()}

    def iteration(self, participants, call):
        """One iteration of the paper's algorithm: E-step and weighted gradients, then the owners' M-step."""
        # phase 1, at Φ^(t-1): client i fetches φ_j for j ∈ N_i itself, E-step, weighted gradients
        ups = call("estep", {i: {"models": {"peers": {j: self.models[j] for j in self.next[i]}}}
                             for i in participants})
        self._absorb_rows(ups)
        # phase 2: owner j receives g_{j<-i} = w_ij ∇φ_j loss(φ_j; D_i) from every i that sampled it (Eq. 8)
        inbox: dict[int, list] = {j: [] for j in participants}
        for i in sorted(ups):
            for j, handle in ups[i]["grads"].items():
                if j in inbox:  # [CHOICE] an owner sitting out this round never receives it
                    inbox[j].append(handle)
        done = call("mstep", {j: {"models": {"grads": inbox[j]}} for j in participants})
        self.models.update({j: u["model"] for j, u in done.items()})
        return ups, inbox

    def _absorb_rows(self, ups):
        for i, u in ups.items():
            self.W[i] = u["w"]
            self.next[i] = list(u["next"])

    def weight_metrics(self) -> dict:
        """Mean self-weight w_ii and, where the partition has groups, two views of "collaborating within the
        group": the weight on same-group OWNERS, and co-usage (W Wᵀ)_ik = Σ_j w_ij w_kj within vs across groups.
        Co-usage does not care which owner's model serves a group: under Eq. 8 φ_j is trained by whoever uses
        it, so a model can end up serving another group than its owner's (EM label switching). On the sine toy
        (Fig. 1: weights concentrate on neighbouring intervals) the band is measured the same way: co-usage of
        adjacent intervals (|g_i - g_k| = 1) against intervals two or more apart."""
        out = {"w_self_mean": float(np.mean(np.diag(self.W))),
               "mixture_members_mean": float(1 + self.mixes().sum(1).mean())}  # own model included
        if self.info.groups is not None:
            g = np.asarray(self.info.groups)
            same = g[:, None] == g[None, :]
            out["w_same_group_mean"] = float(np.mean((self.W * same).sum(1)))
            C, off = self.W @ self.W.T, ~np.eye(len(g), dtype=bool)
            out["cousage_same_mean"] = float(C[same & off].mean()) if (same & off).any() else float("nan")
            out["cousage_cross_mean"] = float(C[~same].mean()) if (~same).any() else float("nan")
            if self.info.task == "regression":  # the sine toy: group g is the g-th interval from the left
                gap = np.abs(g[:, None] - g[None, :])
                out["cousage_neighbour_mean"] = float(C[gap == 1].mean()) if (gap == 1).any() else float("nan")
                out["cousage_far_mean"] = float(C[gap >= 2].mean()) if (gap >= 2).any() else float("nan")
        return out

    def mixes(self) -> np.ndarray:
        """mixes[i, j]: client i's prediction mixes collaborator j's model with its own, w_ij at least
        PRED_MIN_WEIGHT (the paper: the others' weights are (almost) 0). A row's count plus one is what a
        client's evaluation costs in forward passes of each sample."""
        return (self.W >= PRED_MIN_WEIGHT) & ~np.eye(len(self.W), dtype=bool)

    def eval_messages(self, stage, rnd, cids):
        mixes = self.mixes()
        return {i: {"models": {"peers": {int(j): self.models[int(j)] for j in np.flatnonzero(mixes[i])}}}
                for i in cids}

    def round_artifacts(self, rnd):
        return {"W": self.W.copy()}

    def artifacts(self):
        return {"W": self.W.copy()}

    def state_dict(self):
        owners = sorted(self.models)
        return {"models": dict(zip(owners, self.get([self.models[j] for j in owners]))),
                "next": self.next, "W": self.W, "steps": self.steps}

    def load_state_dict(self, state):
        self.models = {j: self.put(v) for j, v in state["models"].items()}
        self.next, self.W, self.steps = dict(state["next"]), np.asarray(state["W"]), int(state["steps"])


# --------------------------------------------------------------------------------------------- client

class FedericoClient(ClientLogic):
    """State per client: ``L`` (EMA losses, length K), ``w`` = softmax(-L), ``next`` (N_i), ``scale`` (n_i/n̄)."""

    private_training = True  # its gradients go through rayfl.privacy (step_estep), its E-step reads val under DP

    def _peer_models(self, client, vectors: list) -> list[nn.Module]:
        """Neighbours' models, each loaded once per host call however many of the host's clients use it."""
        return [client.model_of(v) for v in vectors]

    def init_client(self, client):
        # [CHOICE] independent initialisation per client: with one shared φ^(0) all losses tie at
        # t = 0 and W carries no information until the models have drifted apart.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(client.rng.integers(2**31)))
            client.model = client.new_model()
        s = client.settings
        client.optimizer = training.make_optimizer(client.model.parameters(), s.optimizer, s.lr, s.momentum,
                                                   s.weight_decay)  # lives at the owner only (Eq. 8)

    def _batch(self, client, full: bool = False):
        """A minibatch of the split the E-step reads: training, or validation under sample-level DP."""
        x, y = client.splits["val" if privacy.private_step() else "train"]
        if full or x.shape[0] <= client.settings.batch_size:
            return x, y
        idx = torch.randperm(x.shape[0], generator=client.gen)[: client.settings.batch_size].to(x.device)
        return x[idx], y[idx]

    def _temp(self, client) -> float:
        """Scale of l_ij in the posterior: 1 (mean per sample) or n_i (Eq. 3's sum over D_i)."""
        return float(client.n()) if self.params.loss_sum else 1.0

    def _loss_fn(self, client):
        return training.loss_fn_for(client.settings.task)

    # --- steps -----------------------------------------------------------------------------------
    def step_share(self, client, msg, models):
        return {"model": client.share(client.vector())}

    def step_init(self, client, msg, models):
        """L̂_i at t = 0: every model's mean loss on the full train split, or the own loss everywhere."""
        K, me = msg["K"], client.cid
        x, y = self._batch(client, full=True)
        loss_fn = self._loss_fn(client)
        with torch.no_grad():
            own = float(loss_fn(client.model(x), y))
            L = np.full(K, own)
            peers = models.get("peers", {})
            for j, m in zip(peers, self._peer_models(client, list(peers.values()))):
                L[j] = float(loss_fn(m(x), y))
        L *= self._temp(client)
        w = posterior(L)
        nxt = eps_greedy(w, me, self.params.M, self.params.epsilon, client.rng)
        client.state.update(L=L, w=w, next=nxt, K=K, scale=client.n() / msg["n_mean"])
        s = client.settings
        return {"w": w, "next": nxt, "steps": s.local_epochs * -(-client.n() // s.batch_size)}

    def step_estep(self, client, msg, models):
        """E-step on the sampled entries, then the weighted gradients at the OLD parameters (§3.2: both at
    Φ^(t-1))."""
        st, me, p = client.state, client.cid, self.params
        peers = models.get("peers", {})
        owners = [me] + list(peers)
        nets = [client.model] + self._peer_models(client, list(peers.values()))
        x, y = self._batch(client)
        loss_fn = self._loss_fn(client)
        private_step = privacy.private_step()
        losses = []
        with torch.no_grad() if private_step else contextlib.nullcontext():
            for net in nets:
                net.train()
                losses.append(loss_fn(net(x), y))  # mean per sample on B_i
        new = [float(v.detach()) * self._temp(client) for v in losses]
        st["L"] = ema_update(st["L"], owners, new, p.beta)  # §3.3, EMA of the losses
        st["w"] = w = posterior(st["L"])  # w_i^(t), used for the gradients below (new w at old Φ, §3.2)
        grads = {}
        private = self._private_grads(client, nets, loss_fn) if private_step else None
        for k, (j, net, loss) in enumerate(zip(owners, nets, losses)):
            scale = float(w[j] * st["scale"])
            if private is not None:  # weighted after the noise: post-processing of the private gradient
                vec = private[k] * scale
            else:
                g = torch.autograd.grad(scale * loss, list(net.parameters()))  # g_{j<-i} = w_ij ∇φ_j (Eq. 8)
                vec = parameters_to_vector([t.detach() for t in g])
            if j == me:
                st["own_grad"] = vec.cpu().numpy()  # the owner's own term w_ii ∇ stays home
            else:
                grads[j] = client.share(vec.cpu().numpy())
        st["next"] = eps_greedy(w, me, p.M, p.epsilon, client.rng)  # N_i^(t+1) from w^(t) (§3.3)
        return {"grads": grads, "w": w, "next": st["next"], "loss": float(losses[0].detach()), "n": client.n()}

    @staticmethod
    def _private_grads(client, nets: list[nn.Module], loss_fn) -> list[torch.Tensor]:
        """∇φ_j of the mean loss of every j in nets on the training split, as one DP-SGD release (each sample's
        gradients for all nets clipped together, noise on each sum: rayfl.privacy), each a flat vector."""
        parts = [(net, list(net.parameters()), loss_fn) for net in nets]
        grads = privacy.private_gradients(parts, *client.splits["train"], client.settings.batch_size)
        return [torch.cat([t.reshape(-1) for t in per_net]) for per_net in grads]

    def step_mstep(self, client, msg, models):
        """φ_i <- OptimizerStep(φ_i, w_ii ∇ own + Σ_{k: i ∈ N_k} g_{i<-k}): the column-i sum of Eq. 8."""
        total = np.array(client.state.pop("own_grad"), dtype=np.float64)
        for g in models.get("grads", []):
            total += g
        flat = torch.as_tensor(total, dtype=torch.float32, device=next(client.model.parameters()).device)
        offset = 0
        for q in client.model.parameters():  # same order as parameters_to_vector in step_estep
            q.grad = flat[offset:offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        client.optimizer.step()
        return {"model": client.share(client.vector())}

    def step_evaluate(self, client, msg, models):
        """The w_i-weighted mixture of own and collaborators' outputs, with their latest models (§3.2)."""
        w = client.state["w"]
        peers = models.get("peers", {})
        owners = [client.cid] + list(peers)
        nets = [client.model] + self._peer_models(client, list(peers.values()))
        return client.evaluate(Mixture(nets, w[owners], client.settings.task))


ALGORITHMS = [
    Algorithm("federico", Params, FedericoServer, FedericoClient,
              "FedeRiCo: decentralized EM over collaborators (ε-greedy neighbours, EMA losses, Eq. 8 updates)",
              work="FedAvg's steps, each also a forward and backward pass of M sampled neighbours' models "
                   "(Sui et al., 2022, Alg. 1)",
              plots={"W": Matrix("FedeRiCo collaborator weights w_ij (row: client, column: collaborator)",
                                 "collaborator j", "client i", diverging=False)}),
]
