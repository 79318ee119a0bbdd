"""A run's description opens with one line that holds the answer (rayfl.tracking.tables.first_line): what
MLflow's folded Overview is sure to show."""

from __future__ import annotations

from conftest import tiny
from rayfl.tracking.tables import first_line, summary_markdown

FINAL = {"step": 2, "test_acc_mean": 0.9123, "test_acc_worst": 0.5, "test_acc_bottom10_mean": 0.625}


class Report:
    """A partition report whose small splits call for a warning."""

    def line(self) -> str:
        return "30 clients"

    def warning(self) -> str:
        return "17 of 30 clients have fewer than 10 validation or test samples"


def test_the_first_line_has_mean_worst_bottom_setting_epsilon_and_caveat():
    cfg = tiny(clients=30, dp_noise=1.0)
    line = first_line(cfg, {**FINAL, "dp_epsilon_max": 3.214}, Report())
    assert line == ("**test accuracy 91.23%** · worst client 50.00% · bottom 10% 62.50% — fedavg on synthetic (iid), "
                    "30 clients, DP ε 3.21. **Caveat:** 17 of 30 clients have fewer than 10 validation or test samples")
    note = summary_markdown(cfg, FINAL, 3, Report())
    assert note.splitlines()[0] == first_line(cfg, FINAL, Report()) and note.splitlines()[1] == ""


def test_a_regression_run_says_its_loss_and_a_run_without_evaluation_says_so():
    cfg = tiny()
    assert first_line(cfg, {"test_loss_mean": 0.01234, "test_loss_worst": 0.5}).startswith(
        "**test loss 0.0123** · worst client 0.5000 — fedavg")
    assert first_line(cfg, {}).startswith("**no test evaluation** — fedavg on synthetic")
