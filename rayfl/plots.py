"""Figures logged as MLflow artifacts (headless: the Agg backend). Rounds are counted from 1, as on the console."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

MASK_COLOUR = "#bdbdbd"  # cells without a value (FedFomo: a model the client did not download), hatched


def caption(algo: str, name: str, values) -> tuple[str, tuple[str, str], bool, str | None]:
    """(title, (x label, y label), diverging, what a missing cell means) of the matrix artifact ``name`` of the
    algorithm ``algo``: as the algorithm declares it (``Algorithm.plots``), else a plain caption; diverging (a
    colour map centred at 0) when it says so, or when it leaves that open and some value is negative."""
    from rayfl.algorithms import get_algorithm

    try:
        matrix = get_algorithm(algo).plots.get(name)
    except KeyError:
        matrix = None
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    signed = bool(finite.size and finite.min() < 0)
    if matrix is None:
        return f"{algo}: {name} (row: client, column: client)", ("client j", "client i"), signed, None
    diverging = signed if matrix.diverging is None else matrix.diverging
    return matrix.title, (matrix.xlabel, matrix.ylabel), diverging, matrix.missing


def _wrap(title: str, width: int = 60) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(title, width))


def heatmap(matrix, title: str, xlabel: str = "client j", ylabel: str = "client i", diverging: bool = False,
            missing: str | None = None, ids=None):
    """A client-by-client matrix with integer ticks at the client ids; ``diverging``: a red-blue map centred
    at 0 (signed values); NaN cells drawn in grey, with a legend entry ``missing`` when given."""
    m = np.asarray(matrix, dtype=float)
    ids = list(range(m.shape[0])) if ids is None else list(ids)
    fig, ax = plt.subplots(figsize=(6, 5.2))
    finite = m[np.isfinite(m)]
    if diverging:
        bound = float(np.max(np.abs(finite))) if finite.size else 1.0
        bound = bound or 1.0
        cmap, norm = plt.get_cmap("RdBu_r"), TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound)
    else:
        cmap, norm = plt.get_cmap("viridis"), None
    cmap = cmap.with_extremes(bad=MASK_COLOUR)
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, norm=norm, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="white = 0" if diverging else None)
    step = max(1, int(np.ceil(len(ids) / 20)))  # at most ~20 labels per axis
    ax.set_xticks(range(0, m.shape[1], step), [str(i) for i in range(0, m.shape[1], step)])
    ax.set_yticks(range(0, m.shape[0], step), [str(ids[i]) for i in range(0, m.shape[0], step)])
    for i, j in zip(*np.nonzero(np.isnan(m))):  # hatched too: never mistaken for a pale (near-0) value
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", ec="0.55", lw=0))
    if missing and np.isnan(m).any():
        ax.legend(handles=[Patch(facecolor=MASK_COLOUR, edgecolor="0.55", hatch="///", label=missing)],
                  loc="upper left", bbox_to_anchor=(0.0, -0.12), frameon=False)
    ax.set_title(_wrap(title), fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    plt.close(fig)
    return fig


def matrix_plot(algo: str, name: str, matrix):
    """The heatmap of one algorithm artifact, titled with what it holds."""
    title, (xlabel, ylabel), diverging, missing = caption(algo, name, matrix)
    return heatmap(matrix, title, xlabel, ylabel, diverging=diverging, missing=missing)


def accuracy_plot(history: list[dict], title: str = "", clients: int | None = None):
    """Per round (from 1): test mean, worst client and bottom-10% mean, and the validation mean (loss for
    regression); each stage named over its rounds. With 10 clients or fewer the bottom 10% is one client, the
    worst: its curve is then a wide pale band under the worst client's, and the legend says so."""
    import math

    metric = "acc" if any("test_acc_mean" in h for h in history) else "loss"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = {}
    for split, stat in (("test", "mean"), ("test", "bottom10_mean"), ("test", "worst"), ("val", "mean")):
        key = f"{split}_{metric}_{stat}"
        series[split, stat] = [(h["step"] + 1, h[key]) for h in history if key in h]
    same = bool(series["test", "worst"]) and series["test", "worst"] == series["test", "bottom10_mean"]
    tail = f"{math.ceil(0.1 * clients)} of {clients} clients" if clients else "its clients"
    styles = {("test", "mean"): ("test mean", dict(color="C0", marker="o", lw=2, zorder=3)),
              ("test", "bottom10_mean"): (f"test bottom 10% mean (= worst: {tail})" if same else
                                          "test bottom 10% mean",
                                          dict(color="C1", lw=9, alpha=0.3, solid_capstyle="round", zorder=1)
                                          if same else dict(color="C1", marker="s", ls="--", ms=5, lw=1.5)),
              ("test", "worst"): ("test worst client", dict(color="C3", marker="v", ls=":", ms=6, lw=1.5, zorder=4)),
              ("val", "mean"): ("val mean", dict(color="C2", marker="^", ls="-.", ms=4, zorder=2))}
    for key, (label, style) in styles.items():
        if series[key]:
            ax.plot(*zip(*series[key]), label=label, **style)
    _stage_labels(ax, history)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy" if metric == "acc" else "loss")
    ax.set_title(_wrap(title or f"{'accuracy' if metric == 'acc' else 'loss'} per round", 70), fontsize=10,
                 pad=16 if ax.texts else 6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    plt.close(fig)
    return fig


def _stage_labels(ax, history: list[dict]) -> None:
    """A dotted line where a stage starts, and its name over its rounds in the band between the plot and the
    title (never over a curve or the legend), kept within the plot's width: a one-round stage at the end,
    FedFomo's update, is labelled from the right edge inward."""
    spans: list[list] = []  # [stage, first round, last round]
    for h in history:
        if spans and spans[-1][0] == h.get("stage"):
            spans[-1][2] = h["step"] + 1
        else:
            spans.append([h.get("stage"), h["step"] + 1, h["step"] + 1])
    if len(spans) < 2:
        return
    ax.figure.canvas.draw()  # the axis limits the curves gave
    lo, hi = ax.get_xlim()
    for i, (stage, first, last) in enumerate(spans):
        if i:
            ax.axvline(first - 0.5, color="0.6", ls=":", lw=1)
        x = (first + last) / 2
        where = (x - lo) / (hi - lo)
        ha = "left" if where < 0.15 else "right" if where > 0.85 else "center"
        x = max(first - 0.4, lo) if ha == "left" else min(last + 0.4, hi) if ha == "right" else x
        ax.text(x, 1.01, str(stage), transform=ax.get_xaxis_transform(), ha=ha, va="bottom", fontsize=8,
                color="0.3")


def matrix_rounds(algo: str, name: str, matrices: dict[int, np.ndarray]):
    """A client-by-client matrix at a few rounds side by side, on one colour scale, so that its structure can
    be watched forming (FedFomo's P drawn round by round, as Zhang et al., 2021, Fig. 2 draw its weights)."""
    rounds = sorted(matrices)
    stack = np.stack([np.asarray(matrices[r], dtype=float) for r in rounds])
    finite = stack[np.isfinite(stack)]
    title, (xlabel, ylabel), diverging, _ = caption(algo, name, stack)
    if diverging:
        bound = float(np.max(np.abs(finite))) if finite.size else 1.0
        cmap, norm = plt.get_cmap("RdBu_r"), TwoSlopeNorm(vcenter=0.0, vmin=-(bound or 1.0), vmax=bound or 1.0)
    else:
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        cmap, norm = plt.get_cmap("viridis"), plt.Normalize(lo, hi if hi > lo else lo + 1.0)
    cmap = cmap.with_extremes(bad=MASK_COLOUR)
    n = len(rounds)
    fig, axes = plt.subplots(1, n, figsize=(2.5 * n + 1.0, 3.3), squeeze=False, layout="constrained")
    step = max(1, int(np.ceil(stack.shape[1] / 10)))
    for ax, r, m in zip(axes[0], rounds, stack):
        im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(f"round {r}", fontsize=9)
        ax.set_xticks(range(0, m.shape[1], step))
        ax.set_yticks(range(0, m.shape[0], step))
        ax.tick_params(labelsize=7)
        ax.set_xlabel(xlabel, fontsize=8)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.85, label="white = 0" if diverging else None)
    fig.suptitle(_wrap(title.replace(" summed over rounds", " summed up to each round"), 110), fontsize=10)
    plt.close(fig)
    return fig


def partition_plot(counts: np.ndarray, title: str = ""):
    """Training labels per client, stacked by class, a bar per client: the label distribution as Flower
    Datasets draws it (``plot_label_distributions``: partition on x, counts stacked, legend outside)."""
    counts = np.asarray(counts)
    k, classes = counts.shape
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.4, 0.22 * k + 2.5)), 4.4))
    colours = plt.get_cmap("RdYlGn")(np.linspace(0, 1, classes))
    bottom = np.zeros(k)
    for c in range(classes):
        ax.bar(np.arange(k), counts[:, c], bottom=bottom, width=0.85, color=colours[c], label=str(c))
        bottom += counts[:, c]
    step = max(1, int(np.ceil(k / 30)))
    ax.set_xticks(range(0, k, step))
    ax.set_xlim(-0.6, k - 0.4)
    ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.05)
    ax.set_xlabel("client")
    ax.set_ylabel("training samples")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], title="label", loc="center left", bbox_to_anchor=(1.01, 0.5),
              fontsize=7 if classes > 10 else 8, ncols=1 + classes // 26)
    ax.set_title(_wrap(title or "training labels per client", 90), fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


def metric_vs_knob(df, knob: str, metric: str):
    """A sweep's metric against one swept knob (Tune parent run)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(df[knob], df[metric])
    ax.set_xlabel(knob)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} (final round) per trial, by {knob}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def grid_heatmap(df, x: str, y: str, metric: str, mode: str = "max"):
    """A two-knob grid's metric (mean over repeats), one annotated cell per (x, y), the best one outlined."""
    table = df.pivot_table(index=y, columns=x, values=metric, aggfunc="mean").sort_index().sort_index(axis=1)
    m = table.to_numpy(dtype=float)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.9 * m.shape[1]), max(3.5, 1.4 + 0.55 * m.shape[0])))
    cmap = plt.get_cmap("viridis" if mode == "max" else "viridis_r").with_extremes(bad=MASK_COLOUR)
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, aspect="auto")
    fig.colorbar(im, ax=ax, label=metric)
    ax.set_xticks(range(m.shape[1]), [f"{v:g}" if isinstance(v, float) else str(v) for v in table.columns])
    ax.set_yticks(range(m.shape[0]), [f"{v:g}" if isinstance(v, float) else str(v) for v in table.index])
    lo, hi = (np.nanmin(m), np.nanmax(m)) if np.isfinite(m).any() else (0.0, 1.0)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            if np.isfinite(m[i, j]):
                dark = (m[i, j] - lo) / ((hi - lo) or 1.0) < 0.5
                ax.text(j, i, f"{m[i, j]:.3f}", ha="center", va="center", fontsize=7,
                        color=("white" if dark == (mode == "max") else "black"))
    if np.isfinite(m).any():
        i, j = np.unravel_index(np.nanargmax(m) if mode == "max" else np.nanargmin(m), m.shape)
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(_wrap(f"{metric} (final round) over {y} x {x}; best outlined", 50), fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


def rounds_plot(curves, metric: str, title: str = "", caveat: str = ""):
    """One line per algorithm over rounds: the mean over seeds, a band from the lowest to the highest seed;
    1,000 px wide at MLflow's 100 dpi (its artifact pane), the legend beside the plot. ``caveat``: a line
    under the title (the partition's warning)."""
    fig, ax = plt.subplots(figsize=(10, 4.6))
    scale = 100.0 if "_acc_" in metric else 1.0
    for k, (algo, c) in enumerate(curves.groupby("algo", sort=False)):
        colour = f"C{k % 10}"
        ax.plot(c["round"], c["mean"] * scale, color=colour, marker="o" if len(c) <= 30 else None, ms=3,
                lw=1.8, label=f"{algo} ({int(c['seeds'].max())} seed{'s' if c['seeds'].max() > 1 else ''})")
        if (c["seeds"] > 1).any():
            ax.fill_between(c["round"], c["low"] * scale, c["high"] * scale, color=colour, alpha=0.15, lw=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(metric.replace("_", " ") + (" (%)" if scale == 100.0 else ""))
    full = (title or f"{metric.replace('_', ' ')} per round") + " (band: lowest to highest seed)"
    ax.set_title(_wrap(full, 100) + (f"\n{_wrap(caveat, 110)}" if caveat else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    plt.close(fig)
    return fig
