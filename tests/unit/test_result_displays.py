"""How results read, wherever they are shown: a run's per-round table with its results first, a comparison's
numbers in one format (percent, ± std over seeds) in its Markdown and its notebook display alike, a mistake as
one line in IPython, and the caveats beside the numbers: a worst-client value resting on fewer than 10 test
samples marked († and a footnote) and the partition's warning under a run's closing table."""

from __future__ import annotations

import re
from html import escape

import numpy as np
import pandas as pd
import pytest

from rayfl.comparison.table import WORST_SAMPLES, cell, cells, html, markdown, summarize_runs
from rayfl.metrics import few_samples_note, worst_client_samples
from rayfl.progress import summary_table
from rayfl.tracking.tables import rounds_table
from rayfl.user_input import UserError


def loop_history(rounds: int = 2) -> list[dict]:
    """Rows as the loop keeps them (rayfl.loop: step, stage, then the round's metrics in the order it adds them)."""
    rows = []
    for step in range(rounds):
        row = {"step": step, "stage": "train", "train_loss": 1.0, "round_seconds": 0.1, "client_call_seconds": 0.05,
               "snapshot_seconds": 0.01, "eval_seconds": 0.02}
        for split in ("test", "val"):
            for kind in ("acc", "loss"):
                row.update({f"{split}_{kind}_{s}": 0.5 for s in ("mean", "weighted_mean", "std", "worst",
                                                                 "bottom10_mean")})
        rows.append(row)
    return rows


def test_a_runs_rounds_put_the_results_before_the_timings():
    df = rounds_table(loop_history())
    assert list(df.columns[:8]) == ["round", "stage", "test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean",
                                    "val_acc_mean", "val_acc_worst", "val_acc_bottom10_mean"]
    timings = [c for c in df.columns if c.endswith("_seconds")]
    assert list(df.columns[-len(timings):]) == timings and len(timings) == 4
    assert list(df["round"]) == [1, 2] and len(df.columns) == len(loop_history()[0])  # nothing lost
    # a notebook's elided table (pandas shows the first and the last columns) keeps the headline in view
    with pd.option_context("display.max_columns", 10, "display.width", 1000):
        head = repr(df).splitlines()[0].split()
    assert head[:5] == ["round", "stage", "test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean"]
    # regression: the loss is the headline
    loss = rounds_table([{"step": 0, "stage": "train", "round_seconds": 0.1, "val_loss_mean": 2.0,
                          "test_loss_worst": 3.0, "test_loss_mean": 1.0}])
    assert list(loss.columns) == ["round", "stage", "test_loss_mean", "test_loss_worst", "val_loss_mean",
                                  "round_seconds"]


def test_a_user_error_shows_its_one_line_in_ipython():
    e = UserError("clients=-1: must be an integer >= 1")
    assert e._render_traceback_() == ["rayfl: error: clients=-1: must be an integer >= 1"]
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.user_ns["UserError"] = UserError
        from IPython.utils.capture import capture_output

        with capture_output() as captured:
            shell.run_cell("raise UserError('clients=-1: must be an integer >= 1')")
    finally:
        InteractiveShell.clear_instance()
    assert captured.stdout.strip() == "rayfl: error: clients=-1: must be an integer >= 1"


# --------------------------------------------------------------------------------------------------
# A comparison: one format
# --------------------------------------------------------------------------------------------------
def runs() -> pd.DataFrame:
    """Two rows x two seeds; fedavg's worst client tests on 7 samples in one seed, local's on 12 and 15."""
    return pd.DataFrame({"algo": ["fedavg", "fedavg", "local", "local"], "seed": [0, 1, 0, 1],
                         "test_acc_mean": [0.50, 0.60, 0.90, 0.80], "test_acc_worst": [0.20, 0.30, 0.70, 0.60],
                         "test_acc_bottom10_mean": [0.20, 0.30, 0.70, 0.60],
                         WORST_SAMPLES: [7, 30, 12, 15]})


def test_a_comparisons_cells_are_percent_with_std_over_seeds():
    table = summarize_runs(runs(), ["fedavg", "local"])
    head, rows, notes = cells(table)
    std = np.std([50.0, 60.0], ddof=1)  # 7.0711: the sample std over the two seeds, in points
    assert rows[0][:3] == ["fedavg", "2", f"55.00 ± {std:.2f}"] and rows[0][2] == "55.00 ± 7.07"
    assert rows[1][2] == "85.00 ± 7.07"
    assert cell(0.5, float("nan"), True) == "50.00" and cell(1.23456, 0.1, False) == "1.2346 ± 0.1000"
    text, page = markdown(table), html(table)
    for row in rows:  # the Markdown and the notebook's table: the same cells
        assert "| " + " | ".join(row) + " |" in text
        assert "".join(f"<td>{c}</td>" for c in row) in page
    assert "0.55" not in page and "0.5500" not in page


def test_a_worst_client_on_few_test_samples_is_marked_with_a_footnote():
    table = summarize_runs(runs(), ["fedavg", "local"])
    assert list(table[WORST_SAMPLES]) == [7.0, 12.0]  # the fewest over each row's seeds
    _, rows, notes = cells(table)
    assert rows[0][3] == "25.00 ± 7.07†" and rows[1][3] == "65.00 ± 7.07"  # 12 samples: not marked
    assert rows[0][2].endswith("7.07") and rows[0][4].endswith("7.07")  # the mean and bottom 10% are not
    assert notes == ["† rests on 7 test samples (the worst client's; fewer than 10, it moves in steps of 1/7)"]
    assert markdown(table).endswith("\n\n" + notes[0]) and f"<div>{escape(notes[0])}</div>" in html(table)
    nine = runs().assign(**{WORST_SAMPLES: [9, 30, 10, 15]})  # the bound: 9 is marked, 10 is not
    _, rows, _ = cells(summarize_runs(nine, ["fedavg", "local"]))
    assert rows[0][3].endswith("†") and not rows[1][3].endswith("†")
    assert few_samples_note({"a": 4, "b": 7}) == ("† rests on 4 (a), 7 (b) test samples (the worst client's; "
                                                  "fewer than 10)")
    unknown = runs().drop(columns=[WORST_SAMPLES])  # no count known: nothing marked, no column
    assert "†" not in markdown(summarize_runs(unknown)) and WORST_SAMPLES not in summarize_runs(unknown)


def test_the_worst_clients_sample_count():
    records = [{"test_acc": 0.9, "n_test": 3}, {"test_acc": 0.4, "n_test": 7}, {"test_acc": 0.6, "n_test": 20}]
    assert worst_client_samples(records) == 7
    tied = records + [{"test_acc": 0.4, "n_test": 11}]  # the worst value is reached on 11 samples too
    assert worst_client_samples(tied) == 11
    assert worst_client_samples([{"test_acc": float("nan"), "n_test": 2}, *records]) == 7  # not evaluated: left out
    loss = [{"test_loss": 0.5, "n_test": 30}, {"test_loss": 2.5, "n_test": 4}]  # regression: the highest loss
    assert worst_client_samples(loss) == 4
    assert worst_client_samples([{"val_acc": 0.5, "n_val": 3}]) is None
    assert worst_client_samples([{"test_acc": 0.5}]) is None  # no count: nothing to say


def test_a_runs_closing_table_carries_its_caveats():
    final = {"test_acc_mean": 0.5, "test_acc_weighted_mean": 0.5, "test_acc_std": 0.1, "test_acc_worst": 0.25,
             "test_acc_bottom10_mean": 0.25, "val_acc_mean": 0.4, "val_acc_worst": 0.125}
    lines = summary_table(final, 8, "3 of 3 clients have fewer than 10 validation or test samples").splitlines()
    head = lines[0]
    assert re.match(r"test_acc\s+0\.5000\s+0\.5000\s+0\.1000\s+0\.2500†\s+0\.2500$", lines[1])
    assert lines[1].index("†") == head.index("worst") + len("worst")  # the numbers stay under their headers
    assert len(lines[1]) == len(head) and "†" not in lines[2]
    assert lines[3:] == ["† rests on 8 test samples (the worst client's; fewer than 10, it moves in steps of 1/8)",
                         "caveat: 3 of 3 clients have fewer than 10 validation or test samples"]
    plain = summary_table(final, 10, None).splitlines()
    assert len(plain) == 3 and "†" not in "".join(plain)
    assert summary_table(final) == "\n".join(plain)


def test_tunes_own_reporter_is_silent():
    """rayfl prints a sweep's lines itself: the reporter it gives Tune never reports (Tune's default, in a
    notebook, clears the cell)."""
    from ray.tune import ProgressReporter

    from rayfl.sweep.progress import silent_reporter

    reporter = silent_reporter()
    assert isinstance(reporter, ProgressReporter)
    assert reporter.should_report([], done=False) is False and reporter.should_report([], done=True) is False
