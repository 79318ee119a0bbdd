"""FedMoE: specialized federated learning with a mixture of experts (Listo Zec et al., 2020, arXiv 2010.02056).

Three stages of one run (Algorithm 1), each a Stage of the shared loop:

1. ``fedavg``: FedAvg over the opted-in clients only (a fraction ``opt_out`` = q of the clients never takes
   part); M = round(participation x K) of them per round whatever q is (§4, "FedAvg parameters"). The global
   model with the best mean validation loss over the round's participants is kept (§4, same paragraph).
2. ``specialist``: every client, opted-out ones included, fine-tunes a copy of that global model on all of
   its training data with early stopping on its validation loss (Eq. 5); this is also the paper's
   "Fine-tuned" baseline.
3. ``mixture``: a fresh gate h (the expert architecture with one sigmoid output) mixes the specialist and the
   frozen global model, y = h(x) f_s(x) + (1 - h(x)) f_g(x) (Eq. 6); gate and specialist are trained together
   with early stopping (Eq. 7 with w_g frozen, as §3 and §3.2 say, though Eq. 7 lists w_g).

Evaluation: every client reports its model of the stage (stage 1: the selected global model; 2: the
specialist; 3: the mixture) on its own val/test splits and on the balanced global test set ("global" split:
``global_acc``). The mixture stage's records also carry the same client's FedAvg and fine-tuned numbers
(``fedavg_test_acc``, ``finetuned_global_acc``, ...) so the final round holds Table 1's four columns but Local,
summarised across clients like any split (``fedavg_test_acc_mean``, ``finetuned_global_acc_worst``, ...) in
rounds.csv, the MLflow run and the closing table.

``mixture_loss`` (the paper names no loss for Eq. 6): "paper" (default: Eq. 6 mixes the experts' softmax
outputs, so the loss is -log(h p_s[y] + (1-h) p_g[y])) or "code" (the authors' code mixes log-softmax
outputs, so the loss is h CE_s + (1-h) CE_g: a different objective). The mixture module returns
log-probabilities for the paper's loss, so the platform's cross-entropy evaluation is exactly its NLL; under
"code" the reported test loss is the cross-entropy of softmax(h log p_s + (1-h) log p_g), and predictions
are its argmax (as in the code).

Choices where the paper is silent, written down here:
- Stages 2 and 3 use the run's optimizer (the paper: Adam; pass ``--optimizer adam``) with ``ft_lr``; 0 means
  a fifth of the run's lr, the paper's ratio (1e-5 after FedAvg at 5e-5).
- Early stopping checks the validation loss before training and after every epoch and returns a deep copy
  of the best model (§4: "return the best performing model"; a state_dict alone aliases the live tensors);
  ``patience`` epochs without a strict improvement stop it. With an empty validation split (val_frac = 0)
  the last epoch is kept. Stage 1 checks every ``select_every`` rounds and on its last round.
- The gate's hidden layers are freshly initialised per client (seeded by the client's rng), its last layer
  replaced by a 1-unit Linear (§4 gives no output width; a scalar h as in the authors' code). Needs a model
  ending in nn.Linear, which every rayfl model does.
- Opted-out clients: floor(q K), uniform at random with the driver's seeded rng.
- Stage-1 evaluation reports the model selected so far (the one FedMoE would hand out if stage 1 ended now).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl import training
from rayfl.algorithms.base import Algorithm, Stage
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import weighted_mean

MIXTURE_LOSSES = ("paper", "code")


@dataclass
class FedMoEParams:
    opt_out: float = 0.0  # q: fraction of clients that never take part in FedAvg (paper: 0, 0.9, 0.95)
    specialist_epochs: int = 500  # stage 2 maximum epochs (paper: at most 500, early stopping)
    gate_epochs: int = 500  # stage 3 maximum epochs (paper: at most 500, early stopping)
    patience: int = 50  # epochs without validation improvement (code: 10 checks x 5 epochs)
    ft_lr: float = 0.0  # stages 2-3 lr; 0: run lr / 5 (paper: 1e-5 after FedAvg's 5e-5)
    mixture_loss: str = "paper"  # "paper": -log(h p_s + (1-h) p_g); "code": h CE_s + (1-h) CE_g
    select_every: int = 1  # stage-1 validation every this many rounds (paper: every 50th of 1250)

    def check(self, n_clients: int) -> None:
        if not 0 <= self.opt_out < 1:
            raise ValueError(f"opt_out={self.opt_out}: must be in [0, 1)")
        if math.floor(self.opt_out * n_clients) >= n_clients:
            raise ValueError(f"opt_out={self.opt_out}: leaves no client in FedAvg with clients={n_clients}")
        for name in ("specialist_epochs", "gate_epochs", "patience", "select_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be an integer >= 1")
        if self.ft_lr < 0:
            raise ValueError(f"ft_lr={self.ft_lr}: must be >= 0 (0 means a fifth of the run's lr)")
        if self.mixture_loss not in MIXTURE_LOSSES:
            raise ValueError(f"mixture_loss={self.mixture_loss!r}: allowed: {', '.join(MIXTURE_LOSSES)}")

    def check_config(self, cfg) -> None:
        if cfg.dp_noise > 0 and cfg.dp_level == "user" and (self.opt_out > 0 or cfg.participation < 1):
            raise ValueError(f"dp_level='user' with opt_out={self.opt_out}, participation={cfg.participation}: "
                             "FedMoE's stage 1 samples a fixed number of opted-in clients, which the Poisson-sampled "
                             "user-level accountant does not cover; use opt_out=0 and participation=1")


# --------------------------------------------------------------------------------------------- the mixture

class Mixture(nn.Module):
    """h(x) f_s(x) + (1 - h(x)) f_g(x) over class probabilities (Eq. 6), returned as log-probabilities.

    ``log_space=True`` is the released code's variant: h log p_s + (1 - h) log p_g (not normalized)."""

    def __init__(self, specialist: nn.Module, global_model: nn.Module, gate: nn.Module, log_space: bool = False):
        super().__init__()
        self.specialist, self.global_model, self.gate = specialist, global_model, gate
        self.global_model.requires_grad_(False)  # frozen: w_g is not trained in stage 3 (§3.2)
        self.log_space = log_space

    def gate_value(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x))  # h(x) in (0, 1), shape [B, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.gate(x)  # gate logit; h = sigmoid(a)
        log_ps = F.log_softmax(self.specialist(x), dim=1)
        log_pg = F.log_softmax(self.global_model(x), dim=1)
        if self.log_space:
            h = torch.sigmoid(a)
            return h * log_ps + (1 - h) * log_pg  # code: NLL of this = h CE_s + (1-h) CE_g
        return torch.logaddexp(F.logsigmoid(a) + log_ps, F.logsigmoid(-a) + log_pg)  # log(h p_s + (1-h) p_g)


def mixture_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """NLL of the mixture's output: -log P_mix[y] (paper) or h CE_s + (1-h) CE_g (code's log-space output)."""
    return F.nll_loss(out, y)


def make_gate(client, vec: np.ndarray | None = None) -> nn.Module:
    """The expert architecture with a 1-unit output layer (the sigmoid is in Mixture): freshly initialised from
    the client's rng (Algorithm 1 line 3), or loaded from ``vec``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(client.rng.integers(2**31)) if vec is None else 0)
        gate = client.new_model()
        last = gate[-1] if isinstance(gate, nn.Sequential) else None
        if not isinstance(last, nn.Linear):
            raise ValueError("fedmoe: the gate needs a model ending in nn.Linear (every rayfl model does)")
        gate[-1] = nn.Linear(last.in_features, 1).to(client.device)
    return gate if vec is None else client.load(vec, gate)


@torch.no_grad()
def nll(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, batch: int | None = None) -> float:
    if x.shape[0] == 0:
        return float("nan")
    model.eval()
    batch = batch or training.pass_size(model, x, 1024)
    total = sum(float(loss_fn(model(x[s:s + batch]), y[s:s + batch])) * min(batch, x.shape[0] - s)
                for s in range(0, x.shape[0], batch))
    return total / x.shape[0]


def fit_early_stopping(client, model: nn.Module, params, loss_fn, max_epochs: int, patience: int,
                       lr: float) -> dict:
    """Epochs on the training split until ``patience`` epochs pass without a lower validation loss; the model
    is left at its best epoch (a deep copy: a state_dict alone aliases the live tensors and would end at the
    last epoch). Epoch 0 counts."""
    s = client.settings
    opt = training.make_optimizer(params, s.optimizer, lr, s.momentum, s.weight_decay)
    (x, y), (xv, yv) = client.splits["train"], client.splits["val"]
    has_val = xv.shape[0] > 0
    best = nll(model, xv, yv, loss_fn) if has_val else float("inf")
    best_state, best_epoch, wait, epoch = copy.deepcopy(model.state_dict()), 0, 0, 0
    for epoch in range(1, max_epochs + 1):
        training.train_epochs(model, x, y, 1, s.batch_size, opt, loss_fn, client.gen)
        if not has_val:
            best_state, best_epoch = None, epoch
            continue
        v = nll(model, xv, yv, loss_fn)
        if v < best:
            best, best_state, best_epoch, wait = v, copy.deepcopy(model.state_dict()), epoch, 0
        else:
            wait += 1
            if wait >= patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    return {"best_epoch": best_epoch, "epochs": epoch, "best_val_loss": best if has_val else float("nan")}


# --------------------------------------------------------------------------------------------- driver

class FedMoEServer(FedAvgServer):
    averages = "global_ref"  # stage 1 is FedAvg's averaging (user-level DP clips and noises it)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.info.n_clients
        out = self.rng.choice(k, size=math.floor(self.params.opt_out * k), replace=False)
        self.opt_in = [c for c in range(k) if c not in set(out.tolist())]
        self.per_round = min(len(self.opt_in), max(1, int(round(self.info.participation * k))))
        self.best_ref, self.best_val, self.best_round = None, float("inf"), -1
        self.selection: list[dict] = []

    def stages(self):
        # stage 1 samples its own participants among the opted-in clients, so no stage is sampled by the loop;
        # each stage names the knobs it reads, so trials that differ only in later ones share it
        return [Stage("fedavg", self.info.rounds, sample=False, depends_on=("opt_out", "select_every")),
                Stage("specialist", 1, sample=False, depends_on=("specialist_epochs", "patience", "ft_lr")),
                Stage("mixture", 1, sample=False)]

    def selected(self):
        return self.best_ref if self.best_ref is not None else self.global_ref

    def run_round(self, stage, rnd, participants, call):
        if stage.name == "fedavg":
            return self._fedavg_round(rnd, call)
        ups = call(stage.name, {c: {"models": {"global": self.selected()}} for c in participants})
        metrics = {}
        for key in ("best_epoch", "epochs", "best_val_loss", "gate_mean"):
            vals = [u[key] for u in ups.values() if key in u and u[key] == u[key]]
            if vals:
                metrics[f"{stage.name}_{key}"] = float(np.mean(vals))
        return metrics

    def _fedavg_round(self, rnd, call):
        """Eq. (2) over M sampled opted-in clients, then model selection on their validation loss (§4)."""
        sampled = sorted(int(c) for c in self.rng.choice(self.opt_in, size=self.per_round, replace=False))
        ups = self.train_and_average(call, {c: {"models": {"global": self.global_ref}} for c in sampled})
        metrics = {"train_loss": weighted_mean(ups, "train_loss"), "fedavg_participants": float(len(sampled))}
        if (rnd + 1) % self.params.select_every == 0 or rnd == self.info.rounds - 1:
            vals = call("validate", {c: {"models": {"global": self.global_ref}} for c in sampled})
            losses = [u["val_loss"] for u in vals.values() if u["val_loss"] == u["val_loss"]]
            v = float(np.mean(losses)) if losses else float("nan")  # unweighted mean over clients
            if v != v or v < self.best_val:  # no validation data: keep the latest model
                self.best_ref, self.best_val, self.best_round = self.global_ref, v, rnd
            # shown to users with rounds counted from 1, as on the console
            self.selection.append({"round": rnd + 1, "val_loss": v, "selected_round": self.best_round + 1})
            metrics.update(selection_val_loss=v, selected_round=float(self.best_round + 1))
        return metrics

    def eval_messages(self, stage, rnd, cids):
        return {c: {"stage": stage.name, "models": {"global": self.selected()}} for c in cids}

    def final_model(self):
        return self.selected()

    def artifacts(self):
        import pandas as pd

        k = self.info.n_clients
        return {"opt_in": pd.DataFrame({"client": range(k), "opt_in": [c in set(self.opt_in) for c in range(k)]}),
                "selection": pd.DataFrame(self.selection)}

    def state_dict(self):
        return {"global": self.get([self.global_ref])[0], "best": self.get([self.selected()])[0],
                "best_val": self.best_val, "best_round": self.best_round, "selection": self.selection,
                "opt_in": self.opt_in}

    def load_state_dict(self, state):
        self.global_ref, self.best_ref = self.put(state["global"]), self.put(state["best"])
        self.best_val, self.best_round = state["best_val"], state["best_round"]
        self.selection, self.opt_in = state["selection"], state["opt_in"]


# --------------------------------------------------------------------------------------------- client

class FedMoEClient(FedAvgClient):
    uses_holdout = True  # the host adds the balanced global test set as client.splits["global"]
    private_training = True  # stage 1 through client.fit, specialist and gate through training.train_epochs

    def lr(self, client) -> float:
        return self.params.ft_lr or client.settings.lr / 5

    def splits(self, client) -> tuple:
        return ("val", "test", "global") if "global" in client.splits else ("val", "test")

    def step_validate(self, client, msg, models):
        return {"val_loss": client.loss(client.new_model(models["global"]), "val")}

    def step_specialist(self, client, msg, models):
        """Stage 2 (Eq. 5): w_s <- w_g, fine-tuned on all of D^k with early stopping."""
        model = client.new_model(models["global"])
        loss_fn = training.loss_fn_for(client.settings.task)
        info = fit_early_stopping(client, model, list(model.parameters()), loss_fn, self.params.specialist_epochs,
                                  self.params.patience, self.lr(client))
        client.state["finetuned"] = client.vector(model)  # also the "Fine-tuned" baseline
        client.state.pop("gate", None)
        client.load(client.state["finetuned"])
        return info

    def mixture(self, client, global_vec, specialist_vec, gate_vec=None) -> Mixture:
        return Mixture(client.new_model(specialist_vec), client.new_model(global_vec), make_gate(client, gate_vec),
                       log_space=self.params.mixture_loss == "code")

    def step_mixture(self, client, msg, models):
        """Stage 3 (Eqs. 6-7): the stage-2 specialist and a fresh gate trained together; f_g frozen."""
        mix = self.mixture(client, models["global"], client.state["finetuned"])
        params = list(mix.specialist.parameters()) + list(mix.gate.parameters())  # not f_g's
        info = fit_early_stopping(client, mix, params, mixture_loss, self.params.gate_epochs, self.params.patience,
                                  self.lr(client))
        client.state["specialist"] = client.vector(mix.specialist)
        client.state["gate"] = client.vector(mix.gate)
        client.load(client.state["specialist"])
        with torch.no_grad():
            mix.eval()
            x = client.splits["test"][0]
            gate_mean = float(mix.gate_value(x).mean()) if x.shape[0] else float("nan")
        return {"gate_mean": gate_mean, **info}

    def step_evaluate(self, client, msg, models):
        stage, splits = msg.get("stage"), self.splits(client)
        glob = client.new_model(models["global"])
        if stage == "fedavg" or "finetuned" not in client.state:
            client.load(models["global"])
            return client.evaluate(glob, splits)
        finetuned = client.new_model(client.state["finetuned"])
        if stage == "specialist" or "gate" not in client.state:
            return client.evaluate(finetuned, splits)
        mix = self.mixture(client, models["global"], client.state["specialist"], client.state["gate"])
        out = client.evaluate(mix, splits)
        with torch.no_grad():
            mix.eval()
            out["gate_mean"] = float(mix.gate_value(client.splits["test"][0]).mean()) if client.n("test") else float("nan")
        for name, model in (("fedavg", glob), ("finetuned", finetuned)):  # Table 1's other columns
            rec = client.evaluate(model, splits[1:])  # n_test -> n_fedavg_test: its own split in the summary
            out.update({(f"n_{name}_{k[2:]}" if k.startswith("n_") else f"{name}_{k}"): v for k, v in rec.items()})
        return out


ALGORITHMS = [
    Algorithm("fedmoe", FedMoEParams, FedMoEServer, FedMoEClient,
              "FedAvg, then a local specialist and a gate mixing it with the frozen global model",
              work="FedAvg's, then specialist and gate training to early stopping (Listo Zec et al., Alg. 1)"),
]
