"""``rayfl compare``: the table math by hand, the same federation for every algorithm of a seed, the user
errors, and one 2-algorithm x 2-seed comparison on Ray (parent run, 4 children, the table artifact)."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pandas as pd
import pytest
import yaml

from rayfl.comparison.run import build_configs, final_rows
from rayfl.comparison.table import markdown, summarize_runs, with_paper
from rayfl.config import UserError

NO_FINAL_UPDATE = "fedfomo-no-final-update"  # FedFomo's declared second row (Algorithm.compare_before)


def test_mean_and_sample_std_over_seeds_by_hand():
    runs = pd.DataFrame([
        {"algo": "a", "seed": 0, "test_acc_mean": 0.90, "test_acc_worst": 0.70, "test_acc_bottom10_mean": 0.70},
        {"algo": "a", "seed": 1, "test_acc_mean": 0.80, "test_acc_worst": 0.60, "test_acc_bottom10_mean": 0.65},
        {"algo": "a", "seed": 2, "test_acc_mean": 0.70, "test_acc_worst": 0.50, "test_acc_bottom10_mean": 0.60},
        {"algo": "b", "seed": 0, "test_acc_mean": 0.50, "test_acc_worst": 0.40, "test_acc_bottom10_mean": 0.45,
         "global_acc_mean": 0.3},
    ])
    t = summarize_runs(runs).set_index("algo")
    assert t.loc["a", "test_acc_mean"] == pytest.approx(0.80)
    # sample std of (0.9, 0.8, 0.7): sqrt(((0.1)² + 0 + (0.1)²) / 2) = 0.1
    assert t.loc["a", "test_acc_mean_std"] == pytest.approx(0.1)
    assert t.loc["a", "test_acc_bottom10_mean"] == pytest.approx(0.65)
    assert t.loc["a", "test_acc_bottom10_mean_std"] == pytest.approx(0.05)
    assert t.loc["a", "seeds"] == 3 and t.loc["b", "seeds"] == 1
    assert math.isnan(t.loc["b", "test_acc_mean_std"])  # one seed: no spread to report
    assert math.isnan(t.loc["a", "global_acc_mean"]) and t.loc["b", "global_acc_mean"] == pytest.approx(0.3)
    md = markdown(with_paper(summarize_runs(runs), {"a": {"test_acc_mean": 91.3}}))
    assert "| a | 3 | 80.00 ± 10.00 | 60.00 ± 10.00 | 65.00 ± 5.00 | - | 91.3 |" in md
    assert "| b | 1 | 50.00 |" in md


def test_fedfomo_is_shown_with_and_without_its_extra_update():
    history = [{"stage": "train", "test_acc_mean": 0.5}, {"stage": "train", "test_acc_mean": 0.6},
               {"stage": "update", "test_acc_mean": 0.7}]
    rows = final_rows("fedfomo", 3, {"final": history[-1], "history": history, "run_id": "r"})
    assert [(r["algo"], r["test_acc_mean"]) for r in rows] == [("fedfomo", 0.7), (NO_FINAL_UPDATE, 0.6)]
    assert len(final_rows("fedavg", 3, {"final": history[-1], "history": history})) == 1


def test_every_algorithm_of_a_seed_gets_the_same_federation():
    from rayfl.data import build_federation, load_dataset

    cfgs = [cfg for _, cfg in build_configs(["local", "fedavg", "federico"], [0, 1], dataset="digits",
                                            partition="label-groups", groups=3, clients=6, params={"M": 2})]
    assert [(c.algo, c.seed) for c in cfgs] == [(a, s) for a in ("local", "fedavg", "federico") for s in (0, 1)]
    assert cfgs[4].params == {"M": 2} and cfgs[0].params == {}  # a knob goes to the algorithms that have it
    ds = load_dataset(cfgs[0])
    feds = {(c.algo, c.seed): build_federation(c, ds) for c in cfgs}
    for seed in (0, 1):
        ref = feds[("local", seed)]
        for algo in ("fedavg", "federico"):
            for a, b in zip(ref.clients, feds[(algo, seed)].clients):
                assert a.group == b.group
                for split in ("train", "val", "test"):
                    np.testing.assert_array_equal(getattr(a, split), getattr(b, split))
    assert not all(np.array_equal(a.train, b.train)
                   for a, b in zip(feds[("local", 0)].clients, feds[("local", 1)].clients))


def test_federico_paper_numbers_follow_the_groups_run():
    """Table 1 of FedeRiCo has a column per number of distributions: the table shows the one that was run."""
    from rayfl.comparison.presets import PRESETS

    p = PRESETS["federico-label-groups"]
    flat = lambda **kw: build_configs(None, [0], "federico-label-groups", **kw)[0][1].to_flat()  # noqa: E731
    assert p.paper_for(flat())["federico"] == {"test_acc_mean": 69.76}  # the preset's 3 groups
    assert p.paper_for(flat(groups=2))["local"] == {"test_acc_mean": 40.09}
    assert p.paper_for(flat(groups=4))["fedavg"] == {"test_acc_mean": 13.93}
    assert p.paper_for(flat(groups=5)) == {}  # no such column in the paper: no numbers beside ours
    assert PRESETS["persfl-ds1"].paper_for({}) is PRESETS["persfl-ds1"].paper
    rows = build_configs(None, [0], "fedfomo-pathological")  # FedFomo's Table 1: 15 clients, 2 classes each
    path = dict(rows)
    assert [r for r, _ in rows] == ["local", "fedavg", "fedavg-data", "fedprox", "lg-fedavg", "mocha", "cfl",
                                    "perfedavg", "pfedme", "fedfomo", "fedfomo:M=10"]
    assert path["fedfomo"].params == {"M": 5} and path["fedfomo:M=10"].params == {"M": 10}
    path = [cfg for _, cfg in rows]
    assert (path[0].partition, path[0].classes_per_client, path[0].clients) == ("pathological", 2, 15)
    s1, s3 = (build_configs(["usercentric"], [0], name)[0][1] for name in ("usercentric-label-shift",
                                                                       "usercentric-concept"))
    assert (s1.partition, s1.alpha, s1.params) == ("dirichlet", 0.4, {"streams": 0})
    assert (s3.partition, s3.groups, s3.params) == ("permutation", 4, {"streams": 4})


def test_presets_and_user_errors():
    rows = build_configs(None, [0], "persfl-ds1", data_root="/work/shared/datasets/mnist-t10k", rounds=3)
    cfgs = [cfg for _, cfg in rows]
    assert [c.algo for c in cfgs] == ["fedavg", "fedper", "pfedme", "perfedavg", "persfl", "persfl"]
    assert rows[-1][0] == "persfl:variant=gd" and cfgs[-1].params == {"variant": "gd"}
    assert cfgs[0].rounds == 3  # flags override the preset
    assert cfgs[0].classes_per_client == 4 and cfgs[0].clients == 10
    with pytest.raises(UserError, match="preset='nope': unknown"):
        build_configs(None, [0], "nope")
    with pytest.raises(UserError, match="algos: name the algorithms"):
        build_configs([], [0])
    with pytest.raises(UserError, match="algo='fedsgd': unknown"):
        build_configs(["fedsgd"], [0])
    with pytest.raises(UserError, match="param lam: none of local,fedavg has this knob"):
        build_configs(["local", "fedavg"], [0], params={"lam": 0.5})
    with pytest.raises(UserError, match="seeds"):
        build_configs(["local"], [0, 0])
    with pytest.raises(UserError, match="clients=0"):
        build_configs(["local"], [0], clients=0)


def test_a_row_is_an_algorithm_with_its_own_knobs_or_config():
    from rayfl.comparison.run import before_label, metric_key, parse_row

    assert parse_row("fedfomo") == ("fedfomo", {}, {})
    assert parse_row("fedfomo:M=10:val_frac=0.16") == ("fedfomo", {"M": 10}, {"val_frac": 0.16})
    for bad in ("fedfomo:M", "fedfomo:=3", ":M=3", "fedfomo:seed=1", "fedfomo:algo=fedavg"):
        with pytest.raises(UserError, match="a row is ALGO or ALGO:KEY=VALUE"):
            parse_row(bad)
    rows = dict(build_configs(["fedavg", "fedfomo:val_frac=0.16:M=2"], [0], dataset="digits", val_frac=0.0,
                              clients=4))
    assert rows["fedavg"].val_frac == 0.0 and rows["fedfomo:val_frac=0.16:M=2"].val_frac == 0.16
    assert rows["fedfomo:val_frac=0.16:M=2"].params == {"M": 2}
    with pytest.raises(UserError, match="M=9: must be between 1 and the number of clients"):
        build_configs(["fedfomo:M=9"], [0], dataset="digits", clients=4)
    with pytest.raises(UserError, match="nope=1: unknown parameter for algorithm 'fedavg'"):
        build_configs(["fedavg:nope=1"], [0], dataset="digits")
    with pytest.raises(UserError, match="a row is named twice"):
        build_configs(["fedavg", "fedavg"], [0])
    for seeds in ([1.5], "abc", [True]):
        with pytest.raises(UserError, match="seeds="):
            build_configs(["fedavg"], seeds)
    assert before_label("fedfomo", "no-final-update") == NO_FINAL_UPDATE
    assert before_label("fedfomo:M=10", "no-final-update") == NO_FINAL_UPDATE + ":M=10"
    assert metric_key("fedfomo:M=10") == "fedfomo:M_10"


def test_a_row_whose_local_work_differs_from_fedavgs_says_so():
    from rayfl.comparison.run import work_of
    from rayfl.comparison.table import WORK

    assert work_of("fedavg") == work_of("local") == work_of(NO_FINAL_UPDATE) == "as FedAvg"
    assert work_of("persfl:variant=gd").startswith("FedAvg's, then one distillation stage")
    runs = pd.DataFrame([{"algo": a, "seed": 0, "test_acc_mean": 0.5} for a in ("fedavg", "persfl")])
    table = summarize_runs(runs)
    table[WORK] = [work_of(a) for a in table["algo"]]
    lines = markdown(table).splitlines()
    assert lines[0].endswith("| local work |") and lines[2].endswith("| as FedAvg |")
    assert "distillation" in lines[3]
    assert "local work" not in markdown(table[table["algo"] == "fedavg"])  # no row differs: no column


def test_ordering_agreement_by_hand():
    from rayfl.comparison.table import ordering_agreement

    table = pd.DataFrame({"algo": ["a", "b", "c", "d"], "test_acc_mean": [0.9, 0.8, 0.85, 0.5],
                          "test_acc_mean_std": [0.0] * 4, "paper test_acc_mean": [95.0, 90.0, 80.0, math.nan]})
    # the paper orders a > b > c (d has no paper number): pairs (a,b) (a,c) (b,c); ours: a > c > b, so
    # (b, c) is flipped: 2 of 3
    ag = ordering_agreement(table)
    assert (ag.column, ag.agree, ag.pairs, ag.broken) == ("test_acc_mean", 2, 3, [("b", "c")])
    assert ag.line() == ("ordering agreement: 0.67 (2 of the paper's 3 orderings of rows hold on test_acc_mean); "
                         "not held: b above c")
    # a = b in the paper orders nothing; of the other 5 pairs only (b, c) is flipped in ours
    tied = table.assign(**{"paper test_acc_mean": [90.0, 90.0, 80.0, 70.0]})
    assert (ordering_agreement(tied).agree, ordering_agreement(tied).pairs) == (4, 5)
    # the worst-user column when the paper has only that one; a loss column is better lower
    worst = pd.DataFrame({"algo": ["a", "b"], "test_acc_mean": [0.1, 0.9], "test_acc_worst": [0.6, 0.5],
                          "paper test_acc_worst": [50.0, 40.0]})
    assert (ordering_agreement(worst).column, ordering_agreement(worst).agree) == ("test_acc_worst", 1)
    loss = pd.DataFrame({"algo": ["a", "b"], "test_loss_mean": [0.2, 0.3], "paper test_loss_mean": [1.0, 2.0]})
    assert ordering_agreement(loss).agree == 1
    assert ordering_agreement(table.drop(columns=["paper test_acc_mean"])) is None


def test_cli_errors_are_one_line(capsys):
    from rayfl.cli import main

    assert main(["compare", "--algos", "local,nope", "--seeds", "0", "--local"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfl: error: algo='nope': unknown") and err.count("\n") == 1


TINY = dict(dataset="synthetic", partition="iid", clients=3, rounds=2, samples_per_client=60, lr=0.1, batch_size=16)


def test_two_algorithms_two_seeds(mlflow_uri, tmp_path):
    """In process (no Ray): the parent run, its 4 children, the table and chart artifacts."""
    from mlflow.tracking import MlflowClient

    from rayfl.comparison import compare

    lines = []
    res = compare(["local", "fedavg"], [0, 1], runtime="local", tracking_uri=mlflow_uri, experiment="cmp",
                  progress=lines.append, out_dir=str(tmp_path / "runs"), name="two", **TINY)
    # what will run, k/N with an estimate of the time left, and where the result is
    assert lines[0].startswith("compare: 2 rows x 2 seeds = 4 runs (one at a time, in this process)")
    assert [line.split(" partition:")[0] for line in lines[1:3]] == ["compare: seed 0", "compare: seed 1"]
    assert "3 clients; training samples min 36" in lines[1]  # the federation of each seed, once
    done = lines[3:7]
    assert [line.split(" done")[0] for line in done] == [f"compare: {k}/4" for k in (1, 2, 3, 4)]
    # each run's number as the table shows it (percent, two decimals)
    assert re.search(r"\(local s0: test accuracy \d+\.\d\d%\)", done[0]) and ", eta " in done[0]
    assert done[3].endswith("eta 0:00")
    assert lines[7] == f"compare: the table and each run's directory are in {tmp_path / 'runs' / 'compare' / 'two'}"
    assert f"this comparison: {res.mlflow_url}" in lines[8] and res.run_id in res.mlflow_url
    # on disk: the table as logged, and a run directory per (row, seed) with its resolved config
    assert res.out_dir == str(tmp_path / "runs" / "compare" / "two") and res.tracking_unsent is None
    assert sorted(os.listdir(res.out_dir)) == ["fedavg_s0", "fedavg_s1", "local_s0", "local_s1", "runs.csv",
                                               "table.csv", "table.md"]
    assert yaml.safe_load(open(os.path.join(res.out_dir, "local_s1", "config.yaml")))["seed"] == 1
    assert res.markdown in open(os.path.join(res.out_dir, "table.md")).read()
    assert "fedfomo-no-final-update" not in set(res.table["algo"])  # only a FedFomo row has one
    assert len(repr(res).splitlines()) == 2 and "href=" in res._repr_html_()
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(res.run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["compare_algos"] == "local,fedavg"
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{res.run_id}'")
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children)
    by_run = {c.info.run_id: c for c in children}
    for _, r in res.runs.iterrows():  # each table row is its child run's final round (a series' last point)
        assert by_run[r["run_id"]].data.metrics["test_acc_mean"] == pytest.approx(r["test_acc_mean"])
    assert list(res.table["algo"]) == ["local", "fedavg"] and list(res.table["seeds"]) == [2, 2]
    local = res.runs[res.runs.algo == "local"]["test_acc_mean"]
    assert res.table.loc[0, "test_acc_mean_std"] == pytest.approx(np.std(local, ddof=1))
    arts = {a.path for a in client.list_artifacts(res.run_id, "compare")}
    assert {"compare/table.csv", "compare/table.md", "compare/runs.csv", "compare/comparison.png"} <= arts
    table = pd.read_csv(client.download_artifacts(res.run_id, "compare/table.csv", str(tmp_path)))
    assert table["test_acc_mean"].tolist() == pytest.approx(res.table["test_acc_mean"].tolist())
    # one chart of the rows over rounds: each round's mean over seeds (its last, the table's), and its spread;
    # no table cell is a metric of its own
    assert not [k for k in parent.data.metrics if not k.startswith(("compare/", "system/"))]
    # and MLflow's system metrics of the machine that ran the comparison, as its runs have theirs
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(parent.data.metrics)
    assert all("system/cpu_utilization_percentage" in c.data.metrics for c in children)
    curve = client.get_metric_history(res.run_id, "compare/test_acc_mean/fedavg")
    assert [m.step for m in curve] == list(range(1, TINY["rounds"] + 1))
    assert curve[-1].value == pytest.approx(res.table.loc[1, "test_acc_mean"])
    fedavg = res.runs[res.runs.algo == "fedavg"]["test_acc_mean"]
    spread = client.get_metric_history(res.run_id, "compare/test_acc_mean_std/fedavg")
    assert spread[-1].value == pytest.approx(np.std(fedavg, ddof=1))
    assert {"plots/rounds.png"} <= {a.path for a in client.list_artifacts(res.run_id, "plots")}
    # readable in the runs table: the row first in a child's name, row and seed as tags; provenance on both
    assert sorted(c.info.run_name for c in children) == ["fedavg s0", "fedavg s1", "local s0", "local s1"]
    assert {(c.data.tags["rayfl.compare_row"], c.data.tags["rayfl.seed"]) for c in children} == \
        {(a, s) for a in ("local", "fedavg") for s in ("0", "1")}
    for run in (parent, *children):
        assert {"rayfl.version", "rayfl.command"} <= set(run.data.tags)
    parent = client.get_run(res.run_id)  # the description is set once the table is known
    note = parent.data.tags["mlflow.note.content"]
    # first, not folded away: the ranking, best first, narrow; then the full table; the command in wrapping code
    best, other = sorted(res.table.itertuples(), key=lambda r: -r.test_acc_mean)
    assert note.splitlines()[:4] == [
        "| algorithm | test mean (%) |", "|---|---|",
        f"| {best.algo} | {100 * best.test_acc_mean:.2f} ± {100 * best.test_acc_mean_std:.2f} |",
        f"| {other.algo} | {100 * other.test_acc_mean:.2f} ± {100 * other.test_acc_mean_std:.2f} |"]
    assert "| local | 2 |" in note and "```" not in note
    assert " ".join(line.strip("`") for line in note.splitlines() if line.startswith("`")) == \
        parent.data.tags["rayfl.command"]


def test_concurrent_launches_on_ray(ray_session, mlflow_uri, tmp_path):
    """The Ray path: two experiments at once, each a child run of the parent, same numbers as in process."""
    from mlflow.tracking import MlflowClient

    from rayfl.comparison import compare

    kw = dict(tracking_uri=mlflow_uri, experiment="cmp-ray", clients_per_actor=3, out_dir=str(tmp_path), **TINY)
    res = compare(["fedavg"], [0, 1], max_concurrent=2, **kw)
    client = MlflowClient(mlflow_uri)
    children = client.search_runs([client.get_run(res.run_id).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{res.run_id}'")
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    local = compare(["fedavg"], [0, 1], runtime="local", **kw)
    assert res.runs["test_acc_mean"].tolist() == pytest.approx(local.runs["test_acc_mean"].tolist())
