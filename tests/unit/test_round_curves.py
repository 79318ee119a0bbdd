"""A comparison's rows over rounds (rayfl.comparison.curves): the mean, spread and seed count per round,
on numbers worked out by hand, and the chart of them sized for MLflow's artifact pane."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayfl.comparison.curves import metric_name, round_curves


def test_each_round_is_the_mean_and_spread_of_the_seeds_that_evaluated_it():
    histories = {
        "fedavg": [[{"step": 0, "test_acc_mean": 0.5}, {"step": 1}, {"step": 2, "test_acc_mean": 0.7}],
                   [{"step": 0, "test_acc_mean": 0.3}, {"step": 1}, {"step": 2, "test_acc_mean": 0.9}]],
        "local": [[{"step": 0, "test_acc_mean": 0.4}, {"step": 2, "test_acc_mean": float("nan")}]],
    }
    c = round_curves(histories, "test_acc_mean")
    fedavg = c[c.algo == "fedavg"]
    assert list(fedavg["round"]) == [1, 3]  # round 2 evaluated nobody
    assert fedavg["mean"].tolist() == pytest.approx([0.4, 0.8])
    assert fedavg["std"].tolist() == pytest.approx([math.sqrt(0.02), math.sqrt(0.02)])  # (0.1² + 0.1²) / 1
    assert fedavg["low"].tolist() == pytest.approx([0.3, 0.7]) and fedavg["high"].tolist() == pytest.approx([0.5, 0.9])
    assert fedavg["seeds"].tolist() == [2, 2]
    local = c[c.algo == "local"]  # one seed: no spread; a non-finite value (a diverged round) is no point
    assert local[["round", "mean", "std", "seeds"]].values.tolist() == [[1, 0.4, 0.0, 1]]


def test_the_curve_metrics_are_one_chart_per_statistic():
    assert metric_name("test_acc_mean", "mean", "fedavg") == "compare/test_acc_mean/fedavg"
    assert metric_name("test_acc_mean", "std", "fedfomo:M=5") == "compare/test_acc_mean_std/fedfomo:M_5"


def test_the_rounds_chart_fits_the_artifact_pane(tmp_path):
    from PIL import Image

    from rayfl.plots import rounds_plot

    rng = np.random.default_rng(0)
    histories = {algo: [[{"step": s, "test_acc_mean": 0.1 + 0.05 * s + 0.02 * rng.random()} for s in range(20)]
                        for _ in range(3)] for algo in ("fedavg", "fedfomo", "local", "pfedme", "cfl")}
    fig = rounds_plot(round_curves(histories, "test_acc_mean"), "test_acc_mean", "fedfomo-pathological",
                      caveat="17 of 30 clients have fewer than 10 test samples")
    fig.savefig(tmp_path / "rounds.png")
    width, height = Image.open(tmp_path / "rounds.png").size
    assert width <= 1200 and height <= 600
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][0] == "fedavg (3 seeds)"
