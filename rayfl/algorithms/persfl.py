"""PersFL (Divi, Farrukh and Celik, 2021, arXiv 2105.15191, §4.1): distillation from each client's best
FedAvg round.

Stage 1 ("fedavg") is FedAvg itself (the baselines' server and client, reused). Every client also checks
each global model it receives on its own validation split and keeps the one with the lowest cross-entropy as
its *teacher* O_k, replacing it only on strict improvement (Eq. 2, Algorithm 1 lines 1-11; one best loss
per client, though the algorithm writes a single l_k'). The candidates are the copies received at the start of
rounds 1..E_G (§4.1: each user "stores the global model's current copy before updating" it, so round 1's is the
initial model) plus the final aggregate, checked at the start of stage 2 (the paper does not name it); the
recorded ``teacher_round`` is the number of aggregations the teacher had seen (0 = initial model, E_G = final).

Stage 2 ("distill", one round, no communication but the teacher bookkeeping): per client and per grid point
(λ, T), the student starts as a copy of the teacher and trains on the client's training split on

    (1-λ)·CE(y, A(x)) + λ·T²·KL(softmax(O(x)/T) || softmax(A(x)/T))          (Eq. 3 / Algorithm 1)

with O frozen (its logits computed once, in eval mode). The grid point with the best *validation* accuracy
is kept (ties: lower validation loss, then the first point in (λ, T) order; the test split is never read).
``variant="gd"`` uses Eq. 7's cross-entropy soft loss instead of KL; ``teacher="final"`` distils from the
final FedAvg model (the Table 4 ablation).

Choices where the paper is silent, written down here:
- KL direction: teacher first. Eq. 3 and Eq. 7 write the *prediction first, target second*
  (``L_cross(σ(A(x)), y)``), so Eq. 3's ``KL(σ(A/T), σ(O/T))`` reads, in that convention, as the target σ(O/T)
  against the prediction, i.e. KL(teacher || student), as Algorithm 1 and the prose say. The KL is summed over
  classes and averaged over the batch ("batchmean": a mean over batch x classes would shrink the soft term).
  The GD variant then has the same gradients (CE = KL + H(teacher)); only the reported loss value differs.
- Grid default: λ ∈ {0, .25, .5, .75, 1}, T ∈ {1, 5, 9, ..., 25} (inferred from Table 5: the text lists no
  grid). An empty grid means "use the single ``lam`` / ``T``" (a Tune trial sets lam, T and ``lam_grid=() T_grid=()``).
- Every grid point restarts from the teacher with the same batch order (a generator seeded by (seed, client),
  independent of stage 1), so one grid point run alone (a Tune trial) equals that point inside the grid. Under
  sample-level DP each point is a release of its own and draws its own Poisson batches and noise, keyed by the
  point (``rayfl.privacy.release_key``): the accountant composes the points as independent releases, which
  students sharing one batch and noise sequence are not; a point alone still equals that point in the grid. Stage 1
  reads no PersFL knob (``depends_on=()``), so runs that differ only in stage-2 knobs share it through the
  platform's stage cache (``stage_cache``; on in ``rayfl tune``).
- ``distill_epochs=0`` means the run's ``local_epochs`` (Algorithm 1 loops E_L epochs in stage 2); the
  optimizer and learning rate are the run's.
- Non-participants of a stage-1 round (participation < 1; the paper has full participation) still receive the
  global model to check it as a teacher candidate, so every client tracks every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import Algorithm, Stage
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import weighted_mean
from rayfl import privacy, training

if TYPE_CHECKING:
    import pandas as pd

VARIANTS = ("sgd", "gd")  # sgd: PersFL's KL soft loss (Eq. 3, trained by plain SGD); gd: PersFL-GD (Eq. 7)
TEACHERS = ("best", "final")
LAM_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)  # inferred from Table 5: each mean there is a fifth of a grid sum
T_GRID = (1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0)  # inferred from Table 5, likewise


@dataclass
class PersFLParams:
    lam: float = 0.5  # imitation parameter λ, used when lam_grid is empty
    T: float = 1.0  # temperature, used when T_grid is empty
    lam_grid: tuple = LAM_GRID  # per-client grid over λ, selected on validation; () = use lam
    T_grid: tuple = T_GRID  # per-client grid over T, selected on validation; () = use T
    distill_epochs: int = 0  # epochs per grid point in stage 2; 0 = the run's local_epochs (Algorithm 1: E_L)
    variant: str = "sgd"  # sgd: KL soft loss (Eq. 3); gd: cross-entropy soft loss (Eq. 7)
    teacher: str = "best"  # best: each client's optimal round (Eq. 2); final: the last FedAvg model (Table 4)

    def grid(self) -> list[tuple[float, float]]:
        """(λ, T) points in the order ties are broken: λ outer, T inner, as given (Table 5's many
        T = 1, λ = 0 picks say the first point wins a tie)."""
        return [(float(lam), float(t)) for lam in (self.lam_grid or (self.lam,)) for t in (self.T_grid or (self.T,))]

    def check(self, n_clients: int) -> None:
        for lam in (self.lam, *self.lam_grid):
            if not 0 <= lam <= 1:
                raise ValueError(f"lam={lam}: λ must be in [0, 1] (lam and every lam_grid value)")
        for t in (self.T, *self.T_grid):
            if not t > 0:
                raise ValueError(f"T={t}: the temperature must be > 0 (T and every T_grid value)")
        if self.distill_epochs < 0:
            raise ValueError(f"distill_epochs={self.distill_epochs}: must be >= 0 (0 = the run's local_epochs)")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}: allowed: {', '.join(VARIANTS)}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher={self.teacher!r}: allowed: {', '.join(TEACHERS)}")

    def check_config(self, cfg) -> None:
        if cfg.val_frac <= 0:
            raise ValueError(f"val_frac={cfg.val_frac}: PersFL picks teachers and (lam, T) on each client's "
                             f"validation split, so it must be > 0")
        if cfg.dataset == "sine":
            raise ValueError("dataset='sine': PersFL distils class logits; it needs a classification dataset")


# ------------------------------------------------------------------------------------------- the math

def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, lam: float,
                 T: float, variant: str = "sgd") -> torch.Tensor:
    """(1-λ)·CE(y, A) + λ·T²·soft, soft = KL(σ(O/T) || σ(A/T)) (Eq. 3) or CE(σ(O/T), σ(A/T)) (Eq. 7 "gd").

    Both on logits (dividing probabilities by T would be wrong); KL summed over classes, averaged over the
    batch."""
    hard = F.cross_entropy(student_logits, y)
    if lam == 0:
        return hard
    log_ps = F.log_softmax(student_logits / T, dim=1)
    pt = F.softmax(teacher_logits.detach() / T, dim=1)
    if variant == "gd":
        soft = -(pt * log_ps).sum(dim=1).mean()  # Eq. 7: cross-entropy against the teacher's soft labels
    else:
        soft = F.kl_div(log_ps, pt, reduction="batchmean")  # Eq. 3: KL(teacher || student)
    return (1 - lam) * hard + lam * T * T * soft  # T² keeps the soft gradients' scale (Sec. 4, Hinton)


def better(score: tuple[float, float], best: tuple[float, float] | None) -> bool:
    """Grid selection on validation: higher accuracy, then lower loss; strict, so the first point wins ties."""
    if best is None:
        return True
    acc, loss = score
    best_acc, best_loss = best
    return acc > best_acc or (acc == best_acc and loss < best_loss)


def stage2_generator(seed: int, cid: int) -> torch.Generator:
    """Batch order of stage 2: from (seed, client) only, so it does not depend on what stage 1 consumed."""
    state = np.random.SeedSequence([seed, cid, 0xD157]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def distill(student, x, y, teacher_logits, lam, T, variant, epochs, batch_size, optimizer, gen) -> float:
    """Minibatch SGD of the student on the distillation loss (Algorithm 1 lines 12-25); last epoch's mean loss.
    Plain training's loop: its batches are of sample indices, so the loss reads each batch's teacher logits
    and labels."""
    index = torch.arange(x.shape[0], device=x.device)
    return training.train_epochs(student, x, index, epochs, batch_size, optimizer,
                                 lambda out, i: distill_loss(out, teacher_logits[i], y[i], lam, T, variant), gen)


# ------------------------------------------------------------------------------------------- driver

class PersFLServer(FedAvgServer):
    averages = "global_ref"  # stage 1 is FedAvg's averaging (user-level DP clips and noises it)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.table: pd.DataFrame | None = None
        self.grid_table: pd.DataFrame | None = None

    def stages(self):
        # stage 1 reads no PersFL knob: runs that differ only in (λ, T, ...) share it (rayfl.stage_cache)
        return [Stage("fedavg", self.info.rounds, depends_on=()), Stage("distill", 1, sample=False)]

    def run_round(self, stage, rnd, participants, call):
        if stage.name == "fedavg":
            return self.fedavg_round(rnd, participants, call)
        return self.distill_round(call)

    def fedavg_round(self, rnd, participants, call):
        """FedAvg; every client also checks the global it receives as a teacher candidate (Alg. 1 l. 3-9)."""
        chosen = set(participants)
        ups = self.train_and_average(call, {c: {"models": {"global": self.global_ref}, "round": rnd,
                                                "train": c in chosen} for c in range(self.info.n_clients)})
        trained = {c: u for c, u in ups.items() if c in chosen}
        return {"train_loss": weighted_mean(trained, "train_loss")}

    def distill_round(self, call):
        cids = list(range(self.info.n_clients))
        call("select_teacher", {c: {"models": {"global": self.global_ref}, "round": self.info.rounds} for c in cids})
        ups = call("distill", {c: {"seed": self.info.seed} for c in cids})
        import pandas as pd

        self.table = pd.DataFrame([{"client": c, "teacher_round": ups[c]["teacher_round"],
                                    "teacher_val_loss": ups[c]["teacher_loss"], "lam": ups[c]["lam"],
                                    "T": ups[c]["T"], "val_acc": ups[c]["val_acc"], "val_loss": ups[c]["val_loss"]}
                                   for c in cids])
        self.grid_table = pd.DataFrame([{"client": c, "lam": g[0], "T": g[1], "val_acc": g[2], "val_loss": g[3]}
                                        for c in cids for g in ups[c]["grid"]])
        return {"train_loss": weighted_mean(ups, "train_loss"),
                "teacher_round_mean": float(self.table.teacher_round.mean()),
                "lam_mean": float(self.table.lam.mean()), "T_mean": float(self.table["T"].mean())}

    def eval_messages(self, stage, rnd, cids):
        return super().eval_messages(stage, rnd, cids) if stage.name == "fedavg" else {c: {} for c in cids}

    def artifacts(self):
        out = {}
        if self.table is not None:
            out["persfl_clients"] = self.table
            out["persfl_grid"] = self.grid_table
        return out

    def state_dict(self):
        return {**super().state_dict(), "table": self.table, "grid_table": self.grid_table}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.table, self.grid_table = state.get("table"), state.get("grid_table")


# ------------------------------------------------------------------------------------------- client

class PersFLClient(FedAvgClient):
    private_training = True  # stage 1 through client.fit, stage 2's distillation through training.train_epochs

    def init_client(self, client):
        client.state.update(teacher=None, teacher_round=-1, teacher_loss=float("inf"))

    def track(self, client, vec: np.ndarray, rnd: int) -> None:
        """Keep ``vec`` as the teacher if its validation loss is strictly lower (Eq. 2, Alg. 1 l. 6-8)."""
        loss = client.loss_of(vec, "val")
        if loss < client.state["teacher_loss"]:
            client.state.update(teacher=np.array(vec, dtype=np.float32), teacher_round=int(rnd), teacher_loss=loss)

    def step_train(self, client, msg, models):
        self.track(client, models["global"], msg["round"])
        return super().step_train(client, msg, models) if msg.get("train", True) else {}

    def step_select_teacher(self, client, msg, models):
        """The final aggregate is the last teacher candidate (Alg. 1 l. 3-9 once more, at stage 2's start)."""
        self.track(client, models["global"], msg["round"])
        if self.params.teacher == "final":
            client.state["final"] = np.array(models["global"], dtype=np.float32)
        return {}

    def step_distill(self, client, msg, models):
        """Per (λ, T): student := teacher, distil on train, score on val; keep the best (Eq. 3,
        Algorithm 1 lines 12-25)."""
        p, s = self.params, client.settings
        source = client.state["teacher"] if p.teacher == "best" else client.state["final"]
        teacher = client.new_model(source)
        x, y = client.splits["train"]
        with torch.no_grad():
            teacher.eval()
            b = training.pass_size(teacher, x, 1024)
            t_logits = torch.cat([teacher(x[i:i + b]) for i in range(0, x.shape[0], b)]) if x.shape[0] \
                else torch.zeros(0, device=x.device)
        epochs = p.distill_epochs or s.local_epochs
        best, best_score, best_point, best_loss, grid, lam0 = None, None, None, float("nan"), [], None
        for lam, T in p.grid():
            if lam == 0 and lam0 is not None:  # λ = 0: T plays no role, same batches -> the same model
                grid.append([lam, T, *lam0])
                continue
            student = client.new_model(source)
            opt = training.make_optimizer(student.parameters(), s.optimizer, s.lr, s.momentum, s.weight_decay)
            with privacy.release_key("grid", lam, T if lam else 0.0):  # under DP: the point's own batches, noise
                train_loss = distill(student, x, y, t_logits, lam, T, p.variant, epochs, s.batch_size, opt,
                                     stage2_generator(int(msg["seed"]), client.cid))
            val_loss, val_acc = training.evaluate(student, *client.splits["val"], s.task)
            grid.append([lam, T, val_acc, val_loss])
            if lam == 0:
                lam0 = (val_acc, val_loss)
            if better((val_acc, val_loss), best_score):
                best, best_score, best_point, best_loss = client.vector(student), (val_acc, val_loss), (lam, T), \
                    train_loss
        client.load(best)
        return {"lam": best_point[0], "T": best_point[1], "val_acc": best_score[0], "val_loss": best_score[1],
                "teacher_round": client.state["teacher_round"], "teacher_loss": client.state["teacher_loss"],
                "train_loss": best_loss, "n": int(x.shape[0]), "grid": grid}


ALGORITHMS = [Algorithm("persfl", PersFLParams, PersFLServer, PersFLClient,
                        "FedAvg, then distillation from each client's best FedAvg round (Divi et al.)",
                        work="FedAvg's, then one distillation stage: distill_epochs per (lam, T) grid point "
                             "(Divi et al., Alg. 1)",
                        # the single lam / T act only when the per-client grid over them is empty: a sweep over
                        # them empties it (else every trial would run the whole grid inside)
                        implies={"lam": {"lam_grid": ()}, "T": {"T_grid": ()}})]
