"""User-level differential privacy as a wrapper of the reduction a server asks for (DP-FedAvg: McMahan, Ramage,
Talwar and Zhang, ICLR 2018, Algorithm 1).

A server that averages (its ``averages`` capability, :mod:`rayfl.algorithms.base`) asks for a
:class:`~rayfl.reduce.WeightedMean`; under ``dp_level=user`` the hosts compute a :class:`~rayfl.reduce.ClippedSum`
of each participant's update from the model it was sent instead (:meth:`UserLevelDP.clipped`), and the driver
noises the total once, divides it by the fixed denominator q·K and counts the step in the run's accountant
(:meth:`UserLevelDP.average`). The server reads its average as it always does; no update is seen unclipped.
"""

from __future__ import annotations

import numpy as np

from rayfl import privacy
from rayfl.algorithms.base import capability
from rayfl.reduce import ClippedSum, WeightedMean


class UserLevelDP:
    """The run's user-level DP: its settings and its accountant's history (one step per averaging round)."""

    def __init__(self, dp: privacy.DPSettings, seed: int, n_clients: int):
        self.dp, self.seed, self.n_clients = dp, seed, n_clients
        self.history: list = []  # [[noise multiplier, sample rate, steps], ...], as Opacus's accountant keeps it

    @classmethod
    def of(cls, cfg) -> "UserLevelDP | None":
        """The run's, or None when its config asks for no user-level DP."""
        dp = privacy.DPSettings.from_config(cfg)
        return cls(dp, cfg.seed, cfg.clients) if dp is not None and dp.level == "user" else None

    def clipped(self, reduce, server) -> ClippedSum | None:
        """What the hosts compute in place of ``reduce``: the clipped sum of every participant's update from the
        model ``server`` sent (the handle its ``averages`` names); None for a reduction that is no average."""
        if not isinstance(reduce, WeightedMean):
            return None
        if reduce.group is not None:
            raise ValueError(f"{type(server).__name__}: dp_level=user clips and noises one average a call; "
                             f"a grouped WeightedMean (group={reduce.group!r}) makes one per group")
        return ClippedSum(reduce.key, getattr(server, capability(server, "averages")), self.dp.clip)

    def average(self, total, start: np.ndarray, rate: float, key: tuple) -> np.ndarray:
        """The round's model from the hosts' clipped sum ``total`` and the model ``start`` the updates are from:
        noised once over q·K (q = ``rate``), the step counted. The noise is drawn from the seed and ``key``
        (round, call) only, so a replayed round draws the same."""
        rng = np.random.default_rng([self.seed, 0xD9, *key])
        privacy.spend(self.history, self.dp.noise, rate, 1, self.dp.accountant)
        return privacy.user_level_average(total, start, self.dp, rate, self.n_clients, rng)

    def epsilon(self) -> float:
        """Every user's ε at the run's δ so far."""
        return privacy.epsilon(self.history, self.dp.delta, self.dp.accountant)
