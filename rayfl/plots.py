"""Figures logged as MLflow artifacts (headless: the Agg backend)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def heatmap(matrix, title: str, xlabel: str = "client j", ylabel: str = "client i"):
    """A client-by-client matrix (FedFomo's P, FedeRiCo's or user-centric weights)."""
    m = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(m, cmap="viridis")
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    plt.close(fig)
    return fig


def accuracy_plot(history: list[dict]):
    """Test accuracy over rounds: mean, worst client and bottom-10% mean (loss for regression)."""
    metric = "test_acc" if any("test_acc_mean" in h for h in history) else "test_loss"
    fig, ax = plt.subplots(figsize=(6, 4))
    for stat in ("mean", "worst", "bottom10_mean"):
        pts = [(h["step"], h[f"{metric}_{stat}"]) for h in history if f"{metric}_{stat}" in h]
        if pts:
            ax.plot(*zip(*pts), marker=".", label=stat)
    ax.set_xlabel("round")
    ax.set_ylabel(metric.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def metric_vs_knob(df, knob: str, metric: str):
    """A sweep's metric against one swept knob (Tune parent run)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(df[knob], df[metric])
    ax.set_xlabel(knob)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig
