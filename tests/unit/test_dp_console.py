"""What a private run shows its user: the header's DP line, ε at the end of every round line, the closing
table's ε row, the run name's mark, the plot title, and FedFomo's exploration rate under a name of its own."""

from __future__ import annotations

import io
import math
import re

from conftest import tiny
from rayfl import privacy
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.progress import ConsoleProgress, format_round, summary_table
from rayfl.runtime import LocalRuntime


def console_of(cfg) -> tuple[str, Loop]:
    """The console lines of a whole in-process run: its plan, then its round records as round events."""
    out = io.StringIO()
    console = ConsoleProgress(out, tty=False)
    p = prepare(cfg)
    console({"event": "plan", "cfg": cfg, "prepared": p, "run_dir": "/tmp/x"})
    loop = Loop(p, LocalRuntime(p)).run()
    for i, h in enumerate(loop.history):
        console({"event": "round", "step": i, "total": len(loop.history), "stage": h.get("stage", ""),
                 "metrics": {**h, "round_seconds": 0.1}, "time": float(i)})
    return out.getvalue(), loop


def test_a_private_runs_header_and_round_lines_say_dp_and_epsilon():
    text, loop = console_of(tiny(algo="fedavg", rounds=3, dp_noise=1.5, dp_clip=0.7, dp_delta=1e-6,
                                 eval_every=2))
    lines = text.splitlines()
    assert "DP-SGD σ=1.5, C=0.7, δ=1e-06 (sample level, RDP accountant)" in lines[0]
    rounds = [line for line in lines if line.startswith("round")]
    assert len(rounds) == 3
    evaluated = [h.get("dp_epsilon_max") for h in loop.history]
    last = None
    for line, eps in zip(rounds, evaluated):
        last = eps if eps is not None else last  # a round without evaluation repeats the last ε
        assert line.endswith(f"ε {last:.3g}"), line
    assert evaluated[1] is None and rounds[1].endswith(f"ε {evaluated[0]:.3g}")


def test_a_plain_run_says_nothing_of_dp():
    text, _ = console_of(tiny(algo="fedavg", rounds=2))
    assert "DP" not in text and "ε" not in text
    assert privacy.run_name("r", tiny()) == "r" and privacy.final_tags(tiny(), {"dp_epsilon_max": 1.0}) == {}


def test_the_closing_tables_epsilon_row_has_no_nan_and_keeps_its_columns_at_any_epsilon():
    for eps in (0.5, 3.25, 123456.0, 2.5e9, 7e15):
        final = {"test_acc_mean": 0.5, "test_acc_weighted_mean": 0.5, "test_acc_std": 0.1, "test_acc_worst": 0.2,
                 "test_acc_bottom10_mean": 0.2, "dp_epsilon_mean": eps / 2, "dp_epsilon_max": eps}
        head, acc, row = summary_table(final).splitlines()
        assert "nan" not in row and row.startswith("dp_epsilon")
        # every column ends where the header's does, and cells stay apart
        ends = [m.end() for m in re.finditer(r"\S+", head)]
        assert [m.end() for m in re.finditer(r"\S+", row)][1:] == ends
        assert [m.end() for m in re.finditer(r"\S+", acc)][1:] == ends
        cells = row.split()[1:]
        assert math.isclose(float(cells[0]), eps / 2, rel_tol=1e-3) and math.isclose(float(cells[3]), eps,
                                                                                     rel_tol=1e-3)


def test_run_name_tags_and_plot_title_of_a_private_run():
    cfg = tiny(dp_noise=1.0)
    assert privacy.run_name("fedavg-synthetic-iid-s0-20261129-062100", cfg) == \
        "DP σ=1 fedavg-synthetic-iid-s0-20261129-062100"
    assert privacy.run_name("x", tiny(dp_noise=2.0, dp_level="user")) == "DP-user z=2 x"
    assert privacy.final_tags(cfg, {"dp_epsilon_max": 3.14159}) == {"rayfl.dp.epsilon": "3.14159"}
    assert privacy.final_tags(cfg, {"dp_epsilon_max": float("nan")}) == {}
    title = privacy.plot_title(cfg, {"dp_epsilon_max": 3.14159})
    assert title.replace("\u00a0", " ") == " · DP σ=1, ε=3.14 at δ=1e-05"
    assert len(__import__("textwrap").wrap("fedavg on synthetic (5 clients, iid, seed 0)" + title, 70)[-1]) > 20


def test_format_round_without_dp_is_unchanged():
    rec = {"step": 0, "total": 2, "stage": "train", "metrics": {"test_acc_mean": 0.5, "test_acc_worst": 0.1,
                                                                "round_seconds": 0.2}}
    assert format_round(rec).endswith("0.20s")
    assert format_round(rec, epsilon=2.0).endswith("ε 2")


def test_fedfomo_logs_its_exploration_rate_under_its_own_name():
    p = prepare(tiny(algo="fedfomo", rounds=2, params={"M": 1}))
    loop = Loop(p, LocalRuntime(p)).run()
    assert all("fedfomo_explore_rate" in h and "epsilon" not in h for h in loop.history)
    assert loop.history[0]["fedfomo_explore_rate"] == 0.3
