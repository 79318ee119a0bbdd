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


# ------------------------------------------------------------------------------------------- a sweep's parent
SWEEP_META = {"algo": "fedavg", "n_trials": 2, "search": "grid", "num_samples": 1, "metric": "val_acc_mean",
              "experiment_id": "7", "swept": ["lr"], "space": {"grid": {"lr": [0.05, 0.2]}, "random": {}},
              "base": {"algo": "fedavg", "dataset": "synthetic", "partition": "iid", "clients": 3}}


def test_a_sweep_parent_opens_on_its_selection_metric_then_the_best_trials_test_mean_and_worst_client():
    import pandas as pd

    from rayfl.sweep.command import sweep_markdown
    from rayfl.tracking.tables import best_trial_line

    final = {"val_acc_mean": 0.8125, "test_acc_mean": 0.79104, "test_acc_worst": 0.5, "test_acc_bottom10_mean": 0.5}
    table = pd.DataFrame({"lr": [0.2, 0.05], "val_acc_mean": [0.8125, 0.7], "status": ["DONE", "DONE"]})
    note = sweep_markdown(SWEEP_META, table, {"lr": 0.2, "val_acc_mean": 0.8125}, ("abc", "lr=0.2 · run"),
                          final=final)
    head, blank, second = note.splitlines()[:3]
    assert head == "**best val_acc_mean 81.25%** · test accuracy 79.10% · worst client 50.00%" == \
        best_trial_line("val_acc_mean", final)
    assert len(head) <= 100 and blank == ""  # a line of its own, short enough for the folded Overview
    assert second.startswith("Best trial: lr=0.2, val_acc_mean 0.8125 (final round), its run [lr=0.2 · run]"
                             "(#/experiments/7/runs/abc)")
    # a regression sweep selects on a loss: four decimals, as a run's first line writes losses
    assert best_trial_line("val_loss_mean", {"val_loss_mean": 0.123456, "test_loss_mean": 0.2, "test_loss_worst": 0.9}) \
        == "**best val_loss_mean 0.1235** · test loss 0.2000 · worst client 0.9000"
    # a best trial without a test evaluation says so rather than a number
    assert best_trial_line("val_acc_mean", {"val_acc_mean": 0.5}) == "**best val_acc_mean 50.00%** · no test evaluation"


def test_a_trial_logs_its_selection_metric_first_under_a_name_mlflow_lists_first():
    """MLflow 3.17 lists metric keys sorted by UTF-16 code units (the compare page's Utils.getKeys, the runs
    table's columns, the chart sections and charts): "Selection/<metric>" sorts before every key a run logs,
    MLflow's own "system/..." included; and the run's Overview lists metrics in the order first logged."""
    from rayfl.tracking.tables import SELECTION_PREFIX, _with_headline

    round_metrics = {"train_loss": 0.3, "val_acc_mean": 0.8, "test_acc_mean": 0.75, "test_acc_worst": 0.5,
                     "test_acc_bottom10_mean": 0.5}
    logged = _with_headline(round_metrics, "val_acc_mean")
    assert list(logged)[0] == "Selection/val_acc_mean" == SELECTION_PREFIX + "val_acc_mean"
    assert logged["Selection/val_acc_mean"] == 0.8 and logged["val_acc_mean"] == 0.8
    others = [*logged, "client/0/test_acc", "setup/seconds", "system/cpu_utilization_percentage", "accuracy/test mean",
              "participants", "tracking_cpu_seconds", "best_val_acc_mean", "ordering_agreement"]
    assert sorted(others, key=lambda k: k.encode("utf-16-be"))[0] == "Selection/val_acc_mean"
    # a round without the metric (no evaluation), and a run outside a sweep, log no Selection/ key
    assert not any(k.startswith(SELECTION_PREFIX) for k in _with_headline({"train_loss": 0.3}, "val_acc_mean"))
    assert not any(k.startswith(SELECTION_PREFIX) for k in _with_headline(round_metrics))
