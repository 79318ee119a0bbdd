"""Figures: rounds from 1 with integer ticks, every curve visible and distinct, signed matrices on a diverging
map centred at 0, missing cells masked with a legend entry, titles that say what a figure holds."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rayfl import plots

HISTORY = [{"step": s, "stage": "fedavg" if s < 4 else "distill", "test_acc_mean": 0.5 + 0.05 * s,
            "test_acc_worst": 0.2 + 0.04 * s, "test_acc_bottom10_mean": 0.2 + 0.04 * s, "val_acc_mean": 0.45 + 0.05 * s}
           for s in range(5)]


def save(fig, name):
    out = os.environ.get("RAYFL_PLOTS_OUT")  # set it to look at the figures
    if out:
        os.makedirs(out, exist_ok=True)
        fig.savefig(os.path.join(out, name), dpi=90)


def test_accuracy_plot_rounds_from_one_every_curve_distinct():
    fig = plots.accuracy_plot(HISTORY, "persfl on digits", clients=10)
    save(fig, "accuracy.png")
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    # worst equals bottom-10% here (10 clients: the bottom 10% is one client): the legend says so, and the
    # bottom-10% curve is a wide pale band under the worst client's line, never hidden by it
    assert set(lines) == {"test mean", "test bottom 10% mean (= worst: 1 of 10 clients)", "test worst client",
                          "val mean"}
    assert list(lines["test mean"].get_xdata()) == [1, 2, 3, 4, 5]  # the console's round numbers
    worst, band = lines["test worst client"], lines["test bottom 10% mean (= worst: 1 of 10 clients)"]
    assert band.get_linewidth() >= 3 * worst.get_linewidth() and band.get_alpha() < 0.5
    assert band.get_zorder() < worst.get_zorder()
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_title() == "persfl on digits"
    assert any(ln.get_linestyle() == ":" and ln.get_label().startswith("_") for ln in ax.get_lines())  # stage line


def test_worst_and_bottom_ten_percent_apart_are_two_ordinary_lines():
    history = [{**h, "test_acc_bottom10_mean": h["test_acc_worst"] + 0.1} for h in HISTORY]
    ax = plots.accuracy_plot(history, "", clients=30).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    worst, bottom = lines["test worst client"], lines["test bottom 10% mean"]
    assert (worst.get_linestyle(), worst.get_marker()) != (bottom.get_linestyle(), bottom.get_marker())


@pytest.mark.parametrize("rounds", [21, 5])
def test_stage_labels_stay_inside_the_axes(rounds):
    """FedFomo's one-round update stage at the right edge, and a long first stage: no label is cut."""
    history = [{"step": s, "stage": "train" if s < rounds - 1 else "update", "test_acc_mean": 0.5 + 0.02 * s,
                "test_acc_worst": 0.3, "test_acc_bottom10_mean": 0.3} for s in range(rounds)]
    fig = plots.accuracy_plot(history, "fedfomo", clients=10)
    save(fig, f"accuracy_stages_{rounds}.png")
    ax = fig.axes[0]
    fig.canvas.draw()
    box, title = ax.get_window_extent(), ax.title.get_window_extent()
    labels = [t for t in ax.texts if t.get_text() in ("train", "update")]
    assert sorted(t.get_text() for t in labels) == ["train", "update"]
    for t in labels:  # within the plot's width, between the plot and its title
        extent = t.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y1 <= extent.y0 and extent.y1 <= title.y0, t


def test_matrix_over_rounds_is_one_figure_on_one_scale():
    rng = np.random.default_rng(0)
    rounds = {r: rng.normal(size=(6, 6)) * r for r in (1, 3, 5)}
    fig = plots.matrix_rounds("fedfomo", "P", rounds)
    save(fig, "fedfomo_P_rounds.png")
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["round 1", "round 3", "round 5"]
    norms = {(ax.images[0].norm.vmin, ax.images[0].norm.vmax) for ax in panels}
    assert len(norms) == 1 and panels[0].images[0].get_cmap().name.startswith("RdBu")  # signed: one scale for all
    assert "FedFomo affinity P" in fig._suptitle.get_text()


def test_signed_matrix_on_a_diverging_map_centred_at_zero():
    P = np.array([[1.0, -20.0, 3.0], [12.0, 1.0, 0.0], [-2.0, 4.0, 1.0]])
    fig = plots.matrix_plot("fedfomo", "P", P)
    save(fig, "fedfomo_P.png")
    im = fig.axes[0].images[0]
    assert im.get_cmap().name.startswith("RdBu")
    assert im.norm.vcenter == 0 and im.norm.vmin == -20 and im.norm.vmax == 20
    assert np.allclose(im.to_rgba(0.0)[:3], im.get_cmap()(0.5)[:3])  # 0 is the map's centre colour
    assert "FedFomo affinity P" in fig.axes[0].get_title()


def test_not_downloaded_cells_masked_with_a_legend_entry():
    W = np.array([[0.4, np.nan, 0.6], [np.nan, 1.0, 0.0], [0.5, 0.5, np.nan]])
    fig = plots.matrix_plot("fedfomo", "weights", W)
    save(fig, "fedfomo_weights.png")
    ax = fig.axes[0]
    im = ax.images[0]
    rgba = im.to_rgba(im.get_array())
    grey = np.array(plots.matplotlib.colors.to_rgba(plots.MASK_COLOUR))
    assert np.allclose(rgba[0, 1], grey) and np.allclose(rgba[2, 2], grey)  # not downloaded
    assert not np.allclose(rgba[1, 2], grey)  # downloaded with weight 0: a colour of the map
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["not downloaded"]


def test_weight_heatmap_titles_and_integer_client_ticks():
    W = np.random.default_rng(0).dirichlet(np.ones(6), size=6)
    fig = plots.matrix_plot("federico", "W", W)
    save(fig, "federico_W.png")
    ax = fig.axes[0]
    assert ax.get_title().replace("\n", " ") == \
        "FedeRiCo collaborator weights w_ij (row: client, column: collaborator)"
    assert list(ax.get_xticks()) == list(range(6)) and [t.get_text() for t in ax.get_yticklabels()] == \
        [str(i) for i in range(6)]


def test_two_knob_grid_heatmap():
    import pandas as pd

    df = pd.DataFrame([{"lam": lam, "T": t, "val_acc_mean": 0.5 + 0.1 * lam + 0.01 * t}
                       for lam in (0.0, 0.5, 1.0) for t in (1, 5, 9)])
    fig = plots.grid_heatmap(df, "T", "lam", "val_acc_mean")
    save(fig, "grid.png")
    ax = fig.axes[0]
    m = ax.images[0].get_array()
    assert m.shape == (3, 3) and m[2, 2] == max(r.val_acc_mean for r in df.itertuples())  # λ rows, T columns
    best = [p for p in ax.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(best) == 1 and best[0].get_xy() == (1.5, 1.5)
