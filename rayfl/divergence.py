"""A run whose numbers stop being numbers has diverged: it ends there, saying so, instead of reporting them.

A model with a NaN weight predicts NaN scores, and an argmax over NaN picks class 0: a diverged MNIST model
"scores" about 10%, a number that reads like a (bad) result. So the loop checks every round it reports: the
training loss the algorithm returns and every client's evaluation losses must be finite, and so must the
global model before a checkpoint is written (the last checkpoint on disk is then the last finite one, from
which ``--resume`` can go on). Plain math, no Ray, no MLflow.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

import numpy as np

TRAIN_LOSSES = ("train_loss",)  # the round metrics an algorithm reports that come from training


class Diverged(RuntimeError):
    """The run produced a non-finite loss or model at round ``round`` (from 1, as the console counts)."""

    def __init__(self, round: int, algo: str, what: str, hint: str = ""):
        self.round, self.algo, self.what, self.hint = round, algo, what, hint
        super().__init__(f"run diverged at round {round}: {algo} {what}" + (f"; {hint}" if hint else ""))

    def __reduce__(self):  # crosses process boundaries (a Ray task's error) with its fields
        return Diverged, (self.round, self.algo, self.what, self.hint)


def _not_finite(value) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not math.isfinite(float(value))


def _kind(values) -> str:
    return "NaN" if any(v != v for v in values) else "inf"


def round_problem(metrics: dict, per_client: dict[int, dict], participants: int = 1) -> str | None:
    """What is not finite in a reported round, or None: the training loss of a round in which some client took
    part (a round that sampled nobody, as Poisson sampling can, has none to report), or a client's loss on a
    split it has samples of (an empty split's NaN is no divergence)."""
    for key in TRAIN_LOSSES if participants else ():
        if _not_finite(metrics.get(key)):
            return f"{key} is {_kind([float(metrics[key])])}"
    bad: dict[str, list[float]] = {}
    for rec in per_client.values():
        for key, value in rec.items():
            if key.endswith("_loss") and rec.get(f"n_{key[:-len('_loss')]}", 1) and _not_finite(value):
                bad.setdefault(key, []).append(float(value))
    if not bad:
        return None
    key = max(bad, key=lambda k: (len(bad[k]), k == "test_loss"))  # the test split's, of as many
    split = key[:-len("_loss")].replace("_", " ")
    return f"{split} loss is {_kind(bad[key])} for {len(bad[key])} of {len(per_client)} clients"


def model_has_nan(vector) -> bool:
    """Whether a model's weight vector holds a NaN or an infinity (anything but a float array: no)."""
    if not isinstance(vector, np.ndarray) or vector.dtype.kind not in "fc":
        return False
    return not np.isfinite(vector).all()


def step_sizes(cfg, params) -> dict[str, float]:
    """A run's step sizes by flat config key: ``lr`` and every knob of its algorithm named ``*lr``
    (``param.<name>``, as :meth:`rayfl.config.Config.to_flat` names it). These, and only these, a resumed run
    may change (a lower step size after a divergence)."""
    sizes = {"lr": cfg.lr}
    if is_dataclass(params):
        sizes.update({f"param.{f.name}": getattr(params, f.name) for f in fields(params)
                      if f.name.endswith("lr") and isinstance(getattr(params, f.name), (int, float))})
    return sizes


def step_flag(key: str, value: float) -> str:
    """The flag that sets one step size: ``--lr 0.05`` or ``-p personal_lr=0.005``."""
    return f"--lr {value:g}" if key == "lr" else f"-p {key[len('param.'):]}={value:g}"


def step_size_hint(cfg, params) -> str:
    """Where to go next: the run's step sizes, halved, as flags to try."""
    return "lower a step size, e.g. " + " or ".join(step_flag(k, v / 2) for k, v in step_sizes(cfg, params).items())
