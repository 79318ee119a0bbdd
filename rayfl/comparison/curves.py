"""Each comparison row's metric over rounds, across its seeds: the mean and its spread per round, what a
chart of algorithms side by side over rounds draws (MLflow's chart view, ``plots/rounds.png``).

Only rounds that evaluate every client carry a test metric; a round is kept for a row when every seed that
reached it has it (a diverged seed stops early and leaves the later rounds to the others: ``seeds`` says how
many each point averages)."""

from __future__ import annotations

import numpy as np
import pandas as pd

COLUMNS = ["algo", "round", "mean", "std", "low", "high", "seeds"]


def round_curves(histories: dict[str, list[list[dict]]], metric: str) -> pd.DataFrame:
    """``histories``: row label -> one history per seed (rounds as the loop records them: ``step`` from 0 and
    the round's metrics). Per row and round (from 1): the mean over seeds, their standard deviation (ddof 1,
    0 for one seed), the lowest and highest seed, and how many seeds."""
    rows = []
    for algo, per_seed in histories.items():
        by_round: dict[int, list[float]] = {}
        for history in per_seed:
            for h in history:
                value = h.get(metric)
                if isinstance(value, (int, float)) and np.isfinite(value):
                    by_round.setdefault(int(h["step"]) + 1, []).append(float(value))
        for rnd in sorted(by_round):
            values = np.array(by_round[rnd])
            rows.append([algo, rnd, values.mean(), values.std(ddof=1) if len(values) > 1 else 0.0, values.min(),
                         values.max(), len(values)])
    return pd.DataFrame(rows, columns=COLUMNS)


def metric_key(label: str) -> str:
    """A row label as MLflow takes it in a metric name (``fedfomo:M=10`` -> ``fedfomo:M_10``)."""
    import re

    return re.sub(r"[^\w\-. :/]", "_", label)


def metric_name(metric: str, stat: str, algo: str) -> str:
    """The MLflow metric of one row's curve: ``compare/test_acc_mean/fedavg`` (stat ``mean``) and
    ``compare/test_acc_mean_std/fedavg``, drawn by round as the step; one chart per name prefix."""
    return f"compare/{metric}{'' if stat == 'mean' else '_' + stat}/{metric_key(algo)}"
