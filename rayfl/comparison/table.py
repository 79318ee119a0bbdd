"""The paper-style table of a comparison: per algorithm, mean ± std over seeds of final-round metrics.

Input is one row per (algorithm, seed) with that run's final-round summary across clients (the loop's
``final``); output is one row per algorithm. The std is the sample std over seeds (ddof = 1; NaN with one
seed). Accuracies are shown in percent, losses as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import pandas as pd

CLASSIFICATION = ("test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean")
REGRESSION = ("test_loss_mean", "test_loss_worst", "test_loss_bottom10_mean")
EXTRA_SUFFIX = "_acc_mean"  # e.g. FedMoE's global_acc_mean, fedavg_test_acc_mean, finetuned_global_acc_mean
ALSO = ("val_acc_mean",)  # for choosing defaults on validation; never used to pick anything here
PRIVACY = ("dp_epsilon_mean", "dp_epsilon_max")  # epsilon reached at the run's delta, across clients (rayfl.privacy)
WEIGHTS = ("w_same_group_mean", "cousage_neighbour_mean", "cousage_far_mean")  # FedeRiCo's collaboration
WORK, SAME_WORK = "local work", "as FedAvg"  # a row's local work per round (Algorithm.work), shown where any differs
SETTINGS = "settings"  # what a row sets apart from the table's other rows (rayfl.comparison.run.row_settings)
# the test samples the worst client's value rests on: a run's (rayfl.metrics.worst_client_samples), a row's
# fewest over its seeds; a worst-client cell resting on fewer than 10 is marked † with a footnote
WORST_SAMPLES = "test_worst_samples"


def columns(runs: pd.DataFrame) -> list[str]:
    """The table's metric columns: the three headline ones, then validation, then any extra accuracy
    column some algorithm reports (FedMoE's four)."""
    base = CLASSIFICATION if "test_acc_mean" in runs else REGRESSION
    extra = sorted(c for c in runs.columns if c.endswith(EXTRA_SUFFIX) and c not in (*base, *ALSO)
                   and not c.startswith("val_"))
    return [c for c in (*base, *ALSO, *PRIVACY, *extra, *WEIGHTS) if c in runs]


def summarize_runs(runs: pd.DataFrame, order: list[str] | None = None) -> pd.DataFrame:
    """One row per algorithm: ``<col>`` (mean over seeds), ``<col>_std`` (sample std), ``seeds``. A run that
    diverged (a ``diverged`` round, rayfl.divergence) has no result: it is left out of the means, and its row
    says where it diverged (``diverged``: the rounds, e.g. "round 2"; "" when none did)."""
    cols = columns(runs)
    out = []
    for algo in order or list(dict.fromkeys(runs["algo"])):
        sub = runs[runs["algo"] == algo]
        failed = sub["diverged"].dropna() if "diverged" in sub else pd.Series([], dtype=float)
        sub = sub[sub["diverged"].isna()] if "diverged" in sub else sub
        row = {"algo": algo, "seeds": int(len(sub)),
               "diverged": ("round " + ", ".join(str(int(r)) for r in failed)) if len(failed) else ""}
        if SETTINGS in runs:
            row[SETTINGS] = next((str(v) for v in runs.loc[runs["algo"] == algo, SETTINGS] if v == v), "")
        if WORST_SAMPLES in runs:
            counts = sub[WORST_SAMPLES].dropna()
            row[WORST_SAMPLES] = float(counts.min()) if len(counts) else math.nan
        for c in cols:
            vals = sub[c].dropna().to_numpy(dtype=np.float64)
            row[c] = float(vals.mean()) if vals.size else math.nan
            row[f"{c}_std"] = float(vals.std(ddof=1)) if vals.size > 1 else math.nan
        out.append(row)
    return pd.DataFrame(out)


def with_paper(table: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """Add ``paper <col>`` columns (percent) where the preset has the paper's value for that algorithm."""
    table = table.copy()
    for c in dict.fromkeys(c for values in paper.values() for c in values):
        table[f"paper {c}"] = [paper.get(a, {}).get(c, math.nan) for a in table["algo"]]
    return table


@dataclass
class Agreement:
    """How many of the paper's pairwise orderings of rows (A above B on ``column``) hold in ours, over the rows
    both have; the paper's ties are left out (they order nothing). ``broken``: the pairs whose order flipped,
    the paper's higher row first."""

    column: str
    agree: int
    pairs: int
    broken: list = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.agree / self.pairs if self.pairs else math.nan

    def line(self) -> str:
        if not self.pairs:
            return f"ordering agreement: - (fewer than two rows with the paper's {self.column})"
        text = (f"ordering agreement: {self.fraction:.2f} ({self.agree} of the paper's {self.pairs} orderings "
                f"of rows hold on {self.column})")
        if self.broken:
            text += "; not held: " + ", ".join(f"{a} above {b}" for a, b in self.broken)
        return text


def ordering_agreement(table: pd.DataFrame) -> Agreement | None:
    """The ordering agreement of a table with its ``paper <column>`` values (:func:`with_paper`), on the paper's
    headline column: the first of the test accuracy (or loss) columns, in table order, that the paper gives
    numbers for. Higher is better for accuracy, lower for loss."""
    given = [c for c in table.columns if c.startswith("paper ") and table[c].notna().any()]
    if not given:
        return None
    names = [c[len("paper "):] for c in given]
    column = next((c for c in (*CLASSIFICATION, *REGRESSION) if c in names), names[0])
    sign = -1.0 if "_loss" in column else 1.0
    rows = [(r["algo"], sign * r[f"paper {column}"], sign * r[column]) for _, r in table.iterrows()
            if r[f"paper {column}"] == r[f"paper {column}"] and r[column] == r[column]]
    agree, pairs, broken = 0, 0, []
    for (a, pa, oa), (b, pb, ob) in combinations(rows, 2):
        if pa == pb:
            continue
        pairs += 1
        hi, lo = (a, b) if pa > pb else (b, a)
        if (pa - pb) * (oa - ob) > 0:
            agree += 1
        else:
            broken.append((hi, lo))
    return Agreement(column, agree, pairs, broken)


def cell(mean: float, std: float, percent: bool) -> str:
    """A comparison's number as every display of it shows it (the Markdown, table.md, the notebook's table):
    ``mean ± std`` over seeds, accuracy in percent with 2 decimals, a loss with 4; no ± with one seed."""
    if mean != mean:
        return "-"
    scale = 100.0 if percent else 1.0
    digits = 2 if percent else 4
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std == std else "")


def _header(column: str) -> str:
    """A column's name as a table header, short enough that MLflow's preview of table.md does not cut it."""
    text = (column.replace("test_acc_", "test ").replace("val_acc_", "val ").replace("test_loss_", "test loss ")
            .replace("bottom10_mean", "bottom 10%").replace("_", " "))
    return text + (" (%)" if "_acc" in column else "")


def cells(table: pd.DataFrame) -> tuple[list[str], list[list[str]], list[str]]:
    """The table as its displays show it: the header, a row of text cells per row (``mean ± std``, accuracy in %,
    :func:`cell`; then the paper's numbers), and the footnotes (a worst-client value marked † rests on fewer
    than 10 test samples)."""
    from rayfl.metrics import FEW_SAMPLES_MARK, few_samples, few_samples_note

    metric_cols = [c for c in table.columns if c not in ("algo", "seeds", "diverged", WORK, SETTINGS, WORST_SAMPLES)
                   and not c.endswith("_std") and not c.startswith("paper ")]
    paper_cols = [c for c in table.columns if c.startswith("paper ")]
    work = [WORK] if WORK in table and (table[WORK] != SAME_WORK).any() else []
    work += [SETTINGS] if SETTINGS in table and (table[SETTINGS] != "").any() else []
    head = ["algorithm", "seeds", *(_header(c) for c in metric_cols), *paper_cols, *work]
    rows, few = [], {}
    for _, r in table.iterrows():
        failed = r.get("diverged") or ""
        row = [str(r["algo"]), str(r["seeds"]) + (f" ({failed.count(',') + 1} diverged)" if failed else "")]
        if failed and not r["seeds"]:  # no seed has a result: say where it broke, not a score
            row += [f"diverged ({failed})"] * len(metric_cols)
        else:
            marked = few_samples(r.get(WORST_SAMPLES))
            if marked:
                few[str(r["algo"])] = int(r[WORST_SAMPLES])
            row += [cell(r[c], r[f"{c}_std"], "_acc" in c)
                    + (FEW_SAMPLES_MARK if marked and c in (CLASSIFICATION[1], REGRESSION[1]) else "")
                    for c in metric_cols]
        row += ["-" if r[c] != r[c] else f"{r[c]:g}" for c in paper_cols]
        row += [str(r[c]) for c in work]
        rows.append(row)
    return head, rows, [few_samples_note(few)] if few else []


def markdown(table: pd.DataFrame) -> str:
    """The table as Markdown (:func:`cells`), its footnotes below it."""
    head, rows, notes = cells(table)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    return "\n".join(lines) + "".join(f"\n\n{note}" for note in notes)


def html(table: pd.DataFrame) -> str:
    """The table as HTML for a notebook: the same cells as :func:`markdown`, its footnotes below it."""
    from html import escape

    head, rows, notes = cells(table)
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>" + "".join(f"<div>{escape(note)}</div>" for note in notes)


def ranking(table: pd.DataFrame) -> str:
    """The answer first, narrow enough for MLflow's Overview at 1366 px: each row by its test mean, best first
    (accuracy highest, loss lowest), as ``mean ± std``, the paper's number and the difference where a preset has
    one; a row with no result last, saying where it diverged."""
    metric = next((c for c in (CLASSIFICATION[0], REGRESSION[0]) if c in table), None)
    if metric is None:
        return ""
    percent, paper = "_acc" in metric, f"paper {metric}"
    has_paper = paper in table and table[paper].notna().any()
    head = ["algorithm", "test mean" + (" (%)" if percent else "")] + (["paper", "Δ"] if has_paper else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    done = table[table[metric] == table[metric]].sort_values(metric, ascending=not percent, kind="stable")
    for _, r in pd.concat([done, table[table[metric] != table[metric]]]).iterrows():
        failed = r.get("diverged") or ""
        cells = [str(r["algo"]), f"diverged ({failed})" if failed and r[metric] != r[metric]
                 else cell(r[metric], r[f"{metric}_std"] if r["seeds"] > 1 else float("nan"), percent)]
        if has_paper:
            ours = r[metric] * (100.0 if percent else 1.0)
            known = r[paper] == r[paper] and ours == ours
            cells += ["-" if r[paper] != r[paper] else f"{r[paper]:g}",
                      f"{ours - r[paper]:+.{2 if percent else 4}f}" if known else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(table: pd.DataFrame, title: str = ""):
    """Bars of the headline columns per algorithm, error bars = std over seeds; the paper's values (where a
    preset has them) as black markers on their bars."""
    from rayfl.plots import _wrap, plt

    cols = [c for c in (*CLASSIFICATION, *REGRESSION) if c in table]
    percent = cols[0].startswith("test_acc")
    fig, ax = plt.subplots(figsize=(min(12.0, max(6, 0.8 * len(table)) + 1.8), 4.2))  # <= 1,200 px at 100 dpi
    names = {"mean": "mean", "worst": "worst client", "bottom10_mean": "bottom 10% mean"}
    width = 0.8 / len(cols)
    x = np.arange(len(table))
    scale = 100.0 if percent else 1.0
    for k, c in enumerate(cols):
        std = table[f"{c}_std"].fillna(0.0).to_numpy() * scale
        pos = x + (k - (len(cols) - 1) / 2) * width
        ax.bar(pos, table[c].to_numpy() * scale, width, yerr=std, capsize=3,
               label=names[c.split("_", 2)[2]])
        if f"paper {c}" in table:
            ax.scatter(pos, table[f"paper {c}"], marker="_", s=300, color="black", zorder=3,
                       label="paper" if not any(t.get_label() == "paper" for t in ax.collections) else None)
    ax.set_xticks(x)
    ax.set_xticklabels(table["algo"], rotation=15 if len(table) <= 6 else 35, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%)" if percent else "test loss")
    ax.set_title(_wrap(title or "final round, mean ± std over seeds", 90), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the bars
    fig.tight_layout()
    plt.close(fig)
    return fig
