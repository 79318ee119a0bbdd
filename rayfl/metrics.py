"""The evaluation summary across clients, after pFL-Bench's protocol (Chen et al., 2022, arXiv 2206.03655).

Every client is evaluated on its own test split; a round is summarised by the unweighted mean, the
sample-weighted mean, the sample standard deviation across clients (PersFL's fairness measure), the
worst client and the mean of the bottom 10% of clients, for accuracy and for loss. Hyperparameters are
chosen on validation, never on test, and the final round is the result, not the best round over test
(reporting the maximum over rounds of test accuracy, as some libraries do, overstates it).
"""

from __future__ import annotations

import math
from itertools import repeat

import numpy as np

MIN_EVAL_SAMPLES = 10  # below this, one sample moves a client's accuracy by more than 10 points
FEW_SAMPLES_MARK = "†"  # beside a worst-client value that rests on fewer than MIN_EVAL_SAMPLES test samples


def summarize(values, weights=None, higher_is_better: bool = True) -> dict[str, float]:
    """Summary statistics of one per-client metric; NaN entries (empty splits) are left out."""
    v = np.asarray(values, dtype=np.float64)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = ~np.isnan(v)
    v, w = v[keep], w[keep]
    if v.size == 0:
        return {k: float("nan") for k in ("mean", "weighted_mean", "std", "worst", "bottom10_mean")}
    ordered = np.sort(v) if higher_is_better else np.sort(v)[::-1]
    tail = ordered[: max(1, math.ceil(0.1 * v.size))]
    return {
        "mean": float(v.mean()),
        "weighted_mean": float((v * w).sum() / w.sum()) if w.sum() > 0 else float("nan"),
        "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "worst": float(ordered[0]),
        "bottom10_mean": float(tail.mean()),
    }


def round_summary(per_client: dict[int, dict], splits=None) -> dict[str, float]:
    """Flat metrics for one round, e.g. ``test_acc_mean``, ``test_loss_worst``, from client records; by
    default for every split a record has a size ``n_<split>`` for (``global``: the balanced held-out set
    FedMoE scores every client on; ``fedavg_test``: FedMoE's FedAvg column, ...). At 1,000 clients this runs
    in the driver every round: each column is read from the records by ``map``, not a Python loop."""
    records = [per_client[c] for c in sorted(per_client)]
    if splits is None:
        splits = sorted(k[2:] for k in set().union(*records) if k.startswith("n_"))
    out: dict[str, float] = {}
    for split in splits:
        n = _column(records, f"n_{split}", 0)
        for metric, higher in (("acc", True), ("loss", False)):
            key = f"{split}_{metric}"
            vals = _column(records, key, math.nan)
            if np.isnan(vals).all():
                continue
            for stat, value in summarize(vals, n, higher).items():
                out[f"{key}_{stat}"] = value
    eps = _column(records, "dp_epsilon", math.nan)  # differential privacy: each client's ε so far (rayfl.privacy)
    if not np.isnan(eps).all():
        out["dp_epsilon_max"], out["dp_epsilon_mean"] = float(np.nanmax(eps)), float(np.nanmean(eps))
    return out


def _column(records: list[dict], key: str, missing: float) -> np.ndarray:
    return np.asarray(list(map(dict.get, records, repeat(key), repeat(missing))), dtype=np.float64)


def worst_client_samples(records, split: str = "test") -> int | None:
    """How many ``split`` samples the worst client's value rests on, from per-client records (the final
    evaluation's, each with ``<split>_acc`` or ``<split>_loss`` and ``n_<split>``): the worst client's count, the
    largest count among clients tied at the worst value (the value is reached on that many). Accuracy when the
    records have it, else loss (the worst is then the highest); None when no client has the metric or a count."""
    def known(value) -> bool:  # evaluated: neither missing nor NaN
        return value is not None and value == value

    records = list(records)
    kind = "acc" if any(known(r.get(f"{split}_acc")) for r in records) else "loss"
    scored = [(float(r[f"{split}_{kind}"]), r.get(f"n_{split}")) for r in records if known(r.get(f"{split}_{kind}"))]
    if not scored or not all(known(n) for _, n in scored):
        return None
    worst = min(v for v, _ in scored) if kind == "acc" else max(v for v, _ in scored)
    return int(max(n for v, n in scored if v == worst))


def few_samples(n) -> bool:
    """Whether a worst-client value resting on ``n`` test samples is marked (:data:`FEW_SAMPLES_MARK`)."""
    return n is not None and n == n and n < MIN_EVAL_SAMPLES


def few_samples_note(counts) -> str:
    """The footnote under a table whose worst-client values are marked: ``† rests on 7 test samples`` (one
    count), or each marked row's own (``counts``: an int, or {row label: count})."""
    if not isinstance(counts, dict):
        return f"{FEW_SAMPLES_MARK} rests on {int(counts)} test samples (the worst client's; fewer than " \
               f"{MIN_EVAL_SAMPLES}, it moves in steps of 1/{int(counts)})"
    if len(set(counts.values())) == 1:
        return few_samples_note(next(iter(counts.values())))
    each = ", ".join(f"{int(n)} ({label})" for label, n in counts.items())
    return f"{FEW_SAMPLES_MARK} rests on {each} test samples (the worst client's; fewer than {MIN_EVAL_SAMPLES})"


def cluster_purity(clusters, groups) -> float:
    """The fraction of clients whose cluster's most common true group is their own (clusters found, e.g. by
    Clustered FL, against a federation's known groups; with the arguments swapped: how whole each group stays)."""
    clusters, groups = np.asarray(clusters), np.asarray(groups)
    return sum(np.bincount(groups[clusters == c]).max() for c in np.unique(clusters)) / len(groups)
