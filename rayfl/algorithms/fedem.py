"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021): federated expectation-maximization over a mixture of M shared components.

Each client's data distribution is a mixture of M underlying distributions shared by every client (Sec. 2,
Assumptions 1-3; the loss ℓ is the components' negative log-likelihood, p_m(y | x) ∝ exp(-ℓ(θ_m; x, y))).
The server holds the M components Θ = (θ_1 .. θ_M); client t holds its mixture weights π_t (length M,
uniform at the start). Round k of Algorithm 1 (client-server FedEM), on each sampled client t, given the
broadcast components Θ^{k-1}:

    E-step      q_t(z_i = m) = π_tm exp(-ℓ(θ_m; x_i, y_i)) / Σ_m' π_tm' exp(-ℓ(θ_m'; x_i, y_i))
                (π = π^{k-1}, Θ = Θ^{k-1}: one E-step per round, before any local training)
    M-step, π   π_tm = (1/n_t) Σ_i q_t(z_i = m)
    M-step, Θ   θ_{m,t} = LocalSolver(J, m, θ_m^{k-1}, q_t, S_t): J local steps on
                (1/n_t) Σ_i q_t(z_i = m) ℓ(θ; x_i, y_i), for every component m
    server      θ_m^k = Σ_t (n_t / n) θ_{m,t}    (weights: training-set sizes n_t, not Σ_i q_im)

and a client's personalized predictor is the mixture h_t(x) = Σ_m π_tm h_{θ_m}(x) (Sec. 2: the Bayes-optimal
predictor under the mixture), here Σ_m π_tm softmax(θ_m(x)); its accuracy and its negative log-likelihood
-log Σ_m π_tm softmax(θ_m(x))_y are what a client reports (a custom ``step_evaluate``). Citations below
name Algorithm 1's steps and Sec. 3.1's EM updates by name.

Work per round: FedEM's client trains all M components, so it does M times FedAvg's local work (the run's
``local_epochs``, ``batch_size``, ``lr`` for each component), plus one forward pass of the M components over
its training split for the E-step, as its paper defines the algorithm. It also sends and receives M models.

Knob: ``M``, the number of components. Default 4, as FedeRiCo's paper (Sui et al., 2022, §4.1) ran FedEM for its
Table 1; the FedEM paper's own default (and its code's ``--n_learners``) is 3.

Choices where the paper is silent (what the authors' code, github.com/omarfoq/FedEM, does in brackets):
- Initialisation: the components are initialised independently, component m from the torch seed
  ``seed + m`` [code: learner m built after ``torch.manual_seed(seed + m)``]. Component 0 is then the run's
  common initial model (rayfl builds it from ``seed``), so ``M = 1`` is FedAvg exactly; components 1..M-1 are
  built once by client 0 in ``setup`` (the server has no model builder). π_t starts uniform [code: same].
- The E-step reads the client's whole training split, models in eval mode, without gradients [code: the
  per-sample losses over the unshuffled training data, in eval mode]. It is computed in log space (a softmax
  over m of log π_m - ℓ_im), so large losses do not underflow to 0/0 [code: the same softmax].
- LocalSolver: the run's local epochs of minibatch SGD, each batch B minimising Σ_{i∈B} q_im ℓ_i / |B|
  (the batch estimate of (1/n_t) Σ_i q_im ℓ_i) [code: the per-sample losses times the samples' q, summed and
  divided by the batch size; ``local_steps`` epochs]. Each component gets its own batch order [code: each
  learner iterates the loader anew] and a fresh optimizer at the run's lr every round, as FedAvg's client
  does [code: each learner keeps its optimizer and the script's lr schedule, e.g. multi-step decay].
- Client sampling (participation < 1; Algorithm 1 has every client take part): each component is averaged
  over the round's participants, Σ_{t∈S} n_t θ_{m,t} / Σ_{t∈S} n_t, FedAvg's convention [code: the average
  runs over ALL clients with n_t / n, a non-sampled client contributing the previous global component].
  A client that sits a round out keeps its π [code: same].
- Evaluation: every client's current π (from its last E-step, before that round's training) with the
  components as averaged at the end of the round [code: same]. The mixture's log-likelihood is taken by
  log-sum-exp of log π_m + log softmax [code: log of the clamped mixture; the same wherever it does not
  underflow]. Classification only (a softmax likelihood); the regression toy ``sine`` is refused.
- The averaging goes through the platform's weighted-mean reduction: the M components share the weight n_t,
  so their concatenation is reduced as one vector and cut back into M (no per-component reduction needed).
- Training loss reported: Σ_m of each component's last-epoch mean weighted loss (the M-step objective).
- The clients' π is kept by the server from the uploads (a participant uploads its new π) and logged as the
  ``pi`` artifact (clients x M), every round and at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rayfl import training
from rayfl.algorithms.base import Algorithm, ClientLogic, Server
from rayfl.algorithms.common import weighted_mean
from rayfl.reduce import WeightedMean

EVAL_BATCH = 1024  # samples per forward pass, at most, in the E-step and the mixture's evaluation


@dataclass
class Params:
    M: int = 4  # mixture components; FedeRiCo's Table 1 ran FedEM with 4, the FedEM paper's default is 3

    def check(self, n_clients: int) -> None:
        if isinstance(self.M, bool) or not isinstance(self.M, (int, np.integer)) or self.M < 1:
            raise ValueError(f"M={self.M!r}: the number of components must be an integer >= 1")

    def check_run(self, info, model) -> None:
        """M components of the network, each held by the server and trained by every client: refused before
        anything starts when three copies of them (the server's, a client's, its update) exceed the memory."""
        from rayfl.data.datasets import check_memory

        try:
            check_memory(f"M={self.M}", 3 * self.M * info.n_params * 4,
                         f"{self.M:,} components of {info.n_params:,} parameters (three float32 copies)")
        except Exception as e:  # noqa: BLE001 - UserError: the engine's way of saying it, as a knob's ValueError
            raise ValueError(str(e)) from None

    def check_config(self, cfg) -> None:
        if cfg.dataset == "sine":
            raise ValueError("dataset='sine': FedEM's components are softmax likelihoods; it needs a "
                             "classification dataset")


# ------------------------------------------------------------------------------------------- the math

def e_step(pi: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """Algorithm 1, E-step: q_im = π_m exp(-ℓ_im) / Σ_m' π_m' exp(-ℓ_im'), per sample i (rows) and component
    m (columns), as a softmax over m of log π_m - ℓ_im (max subtracted: stable for losses in the thousands)."""
    with np.errstate(divide="ignore"):
        logits = np.log(np.asarray(pi, np.float64))[None, :] - np.asarray(losses, np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    q = np.exp(logits)
    return q / q.sum(axis=1, keepdims=True)


def update_pi(q: np.ndarray) -> np.ndarray:
    """Algorithm 1, M-step for π: π_m = (1/n_t) Σ_i q_im."""
    return q.mean(axis=0)


def weighted_loss(out: torch.Tensor, y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Algorithm 1, LocalSolver's objective on a batch: Σ_{i∈B} q_im ℓ(θ_m; x_i, y_i) / |B|, with ℓ the
    cross-entropy -log softmax(out)_y. Written as the mean NLL of q-scaled log-probabilities, which is
    ``F.cross_entropy``'s own path: with q = 1 (M = 1) it is FedAvg's loss to the bit."""
    return F.nll_loss(F.log_softmax(out, dim=1) * q.unsqueeze(1), y)


def local_solver(model, x: torch.Tensor, y: torch.Tensor, q: torch.Tensor, settings, gen) -> float:
    """Algorithm 1, M-step for θ_m: LocalSolver(J, m, θ_m, q, S_t) as the run's minibatch SGD epochs on the
    q-weighted loss (the batches carry sample indices, so the loss reads each sample's q and label)."""
    s = settings
    optimizer = training.optimizer_for(model, s.optimizer, s.lr, s.momentum, s.weight_decay)
    index = torch.arange(x.shape[0], device=x.device)
    return training.train_epochs(model, x, index, s.local_epochs, s.batch_size, optimizer,
                                 lambda out, i: weighted_loss(out, y[i], q[i]), gen)


@torch.no_grad()
def per_sample_losses(models: list, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """ℓ(θ_m; x_i, y_i) for every sample (rows) and component (columns), models in eval mode."""
    cols = []
    for model in models:
        training.set_mode(model, training=False)
        parts = [F.cross_entropy(model(x[s:s + EVAL_BATCH]), y[s:s + EVAL_BATCH], reduction="none")
                 for s in range(0, x.shape[0], EVAL_BATCH)]
        cols.append(torch.cat(parts).double().cpu().numpy())
    return np.stack(cols, axis=1)


def mixture_log_prob(pi: np.ndarray, logits: list) -> torch.Tensor:
    """Sec. 2's personalized predictor in log space: log Σ_m π_m softmax(θ_m(x)), per sample and class."""
    with np.errstate(divide="ignore"):
        log_pi = torch.as_tensor(np.log(np.asarray(pi, np.float64)), dtype=logits[0].dtype,
                                 device=logits[0].device)
    logp = torch.stack([F.log_softmax(o, dim=1) for o in logits])  # (M, B, C)
    return torch.logsumexp(logp + log_pi.view(-1, 1, 1), dim=0)


@torch.no_grad()
def mixture_metrics(models: list, pi: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(negative log-likelihood, accuracy) of the mixture Σ_m π_m softmax(θ_m(x)) on (x, y); NaN when empty."""
    n = x.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    for model in models:
        training.set_mode(model, training=False)
    nll, hits = 0.0, 0
    for s in range(0, n, EVAL_BATCH):
        xb, yb = x[s:s + EVAL_BATCH], y[s:s + EVAL_BATCH]
        logp = mixture_log_prob(pi, [model(xb) for model in models])
        nll -= float(logp.gather(1, yb.view(-1, 1)).double().sum())
        hits += int((logp.argmax(1) == yb).sum())
    return nll / n, hits / n


def split_components(flat: np.ndarray, M: int) -> list[np.ndarray]:
    """The reduced concatenation (θ_1, .., θ_M) cut back into the M components."""
    return np.split(np.asarray(flat), M)


# ------------------------------------------------------------------------------------------- driver

class FedEMServer(Server):
    """Holds the M components (one handle each) and, for logging, every client's latest π."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        M = self.params.M
        self.components: list = []  # handles of θ_1..θ_M, made in setup
        self.pi = np.full((self.info.n_clients, M), 1.0 / M)  # π_t as last uploaded (uniform until then)

    def setup(self, call):
        """Independent initialisations: θ_1 the common initial model (seed), θ_m from seed + m (code)."""
        M = self.params.M
        others = []
        if M > 1:
            ups = call("init", {0: {"seed": self.info.seed, "M": M}})
            others = [self.put(v) for v in ups[0]["components"]]
        self.components = [self.initial, *others]
        return {}

    def messages(self, cids) -> dict:
        """One message, the M component handles, sent to every client."""
        return dict.fromkeys(cids, {"models": {"components": list(self.components)}})

    def run_round(self, stage, rnd, participants, call):
        ups = call("train", self.messages(participants), reduce=WeightedMean("weights", by="n"))
        # Algorithm 1, server: θ_m = Σ_t n_t θ_{m,t} / Σ_t n_t for each m, in one reduction of the concatenation
        self.components = [self.put(v) for v in split_components(ups.reduced["weights"], self.params.M)]
        for c, up in ups.items():
            self.pi[c] = up["pi"]
        rows = self.pi[sorted(ups)]
        return {"train_loss": weighted_mean(ups, "train_loss"), "pi_max_mean": float(rows.max(axis=1).mean())}

    def eval_messages(self, stage, rnd, cids):
        return self.messages(cids)

    def round_artifacts(self, rnd):
        return {"pi": self.pi.copy()}

    def artifacts(self):
        return {"pi": self.pi.copy()}

    def state_dict(self):
        comps = self.get(list(self.components)) if self.components else []
        stacked = np.stack(comps) if comps else np.zeros((0, self.info.n_params), np.float32)
        return {"components": stacked, "pi": self.pi.copy()}

    def load_state_dict(self, state):
        self.components = [self.put(np.array(v)) for v in state["components"]]
        self.pi = np.array(state["pi"], dtype=np.float64)


# ------------------------------------------------------------------------------------------- client

class FedEMClient(ClientLogic):
    """State per client: ``pi``, its mixture weights π_t (length M)."""

    private_training = ("its mixture weights, E-step averages over each client's training data, go to the "
                        "server without noise")

    def init_client(self, client):
        client.state["pi"] = np.full(self.params.M, 1.0 / self.params.M)

    def step_init(self, client, msg, models):
        """Components 2..M freshly initialised from the torch seeds seed + 1 .. seed + M - 1 (authors' code);
        the global torch RNG is left as it was."""
        out = []
        for m in range(1, msg["M"]):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(msg["seed"] + m)
                out.append(client.vector(client.new_model()))
        return {"components": out}

    def step_train(self, client, msg, models):
        """One round of Algorithm 1 on this client: E-step, M-step for π, LocalSolver for every component."""
        comps = list(models["components"])
        x, y = client.splits["train"]
        n = int(x.shape[0])
        if n == 0:  # nothing to learn from: π stays, the components go back untouched, with weight 0
            return {"weights": np.concatenate(comps), "n": 0, "train_loss": float("nan"),
                    "pi": client.state["pi"].copy()}
        losses = per_sample_losses([client.model_of(v) for v in comps], x, y)  # at Θ^{k-1}
        q = e_step(client.state["pi"], losses)  # E-step with π^{k-1}
        client.state["pi"] = update_pi(q)  # M-step for π
        qt = torch.as_tensor(q, dtype=torch.float32, device=x.device)
        trained, total = [], 0.0
        for m, vec in enumerate(comps):  # M-step for Θ: each component on its own q-weighted loss
            model = client.scratch(vec)
            total += local_solver(model, x, y, qt[:, m], client.settings, client.gen)
            trained.append(client.vector(model))
        return {"weights": np.concatenate(trained), "n": n, "train_loss": total,
                "pi": client.state["pi"].copy()}

    def step_evaluate(self, client, msg, models):
        """The personalized mixture Σ_m π_tm softmax(θ_m(x)) on the validation and test splits; reads only."""
        nets = [client.model_of(v) for v in models["components"]]
        out = {}
        for split in ("val", "test"):
            x, y = client.splits[split]
            out[f"{split}_loss"], out[f"{split}_acc"] = mixture_metrics(nets, client.state["pi"], x, y)
            out[f"n_{split}"] = int(x.shape[0])
        return out


ALGORITHMS = [Algorithm("fedem", Params, FedEMServer, FedEMClient,
                        "EM over a mixture of M shared components, personal mixture weights (Marfoq et al. 2021)",
                        work="M times FedAvg's: each of the M components trains the run's epochs on q-weighted "
                             "losses, after one E-step pass (Marfoq et al. 2021, Alg. 1)")]
