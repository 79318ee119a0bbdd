"""The Python API: rayfl.run returns final/history/clients/run_id; rayfl.tune a results table and the parent
run; a user mistake raises rayfl.UserError before Ray starts (naming the nearest key or flag); the run's MLflow
tags, description and metric names; rounds from 1 in history, MLflow and final; short reprs; ``dir(rayfl)`` and
``help(rayfl.run)``; ``rayfl --version``; importing rayfl loads no torch, Ray or MLflow; round wall times and
the ETA."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

import rayfl

TINY = {"dataset": "synthetic", "partition": "iid", "clients": 3, "rounds": 3, "samples_per_client": 60,
        "lr": 0.1, "batch_size": 16}


def test_import_is_cheap_and_version_prints():
    code = ("import sys, rayfl; rayfl.run; rayfl.tune; rayfl.UserError; "
            "print(sorted(m for m in ('torch', 'ray', 'mlflow', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run([sys.executable, "-m", "rayfl.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"rayfl {rayfl.__version__}"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"clients": 0}, "clients=0: must be an integer >= 1"),
    ({"algo": "fedsgd"}, "algo='fedsgd': unknown"),
    ({"colour": "red"}, "unknown config key 'colour'"),
    ({"params": {"nope": 1}}, "nope=1: unknown parameter"),
    ({"params": 3}, "params=3: must be a dict"),
])
def test_user_mistake_raises_before_ray_starts(kwargs, fragment, tmp_path, monkeypatch):
    import ray

    monkeypatch.chdir(tmp_path)
    was_up = ray.is_initialized()
    with pytest.raises(rayfl.UserError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        rayfl.run(**kwargs, progress=False)
    assert ray.is_initialized() == was_up
    assert not os.path.exists(tmp_path / "mlflow.db") and not os.path.exists(tmp_path / "rayfl-runs")


def test_tune_mistakes_raise_user_error(tmp_path):
    with pytest.raises(rayfl.UserError, match="search='bayes'"):
        rayfl.tune(algo="fedavg", search="bayes", progress=False)
    with pytest.raises(rayfl.UserError, match="unknown config key 'colour'"):
        rayfl.tune(algo="fedavg", colour="red", progress=False)


def test_run_returns_all_four_fields(ray_session, mlflow_uri, tmp_path):
    events = []
    result = rayfl.run(algo="fedfomo", params={"M": 2}, **TINY, tracking_uri=mlflow_uri,
                       out_dir=str(tmp_path / "runs"), run_name="api", progress=events.append)
    # final: the last round's summary
    assert 0.0 <= result.final["test_acc_mean"] <= 1.0
    assert result.final["test_acc_worst"] <= result.final["test_acc_mean"]
    # history: one row per round (FedFomo adds an update-only round after the training rounds), counted
    # from 1 (no 0-based step beside it), the final row equal to .final, which names its round
    n = len(result.history)
    assert n >= TINY["rounds"] and list(result.history["round"]) == list(range(1, n + 1))
    assert "step" not in result.history and list(result.history.columns[:2]) == ["round", "stage"]
    assert result.history.iloc[-1]["test_acc_mean"] == result.final["test_acc_mean"]
    assert result.final["round"] == n and result.final["stage"] == "update" and "step" not in result.final
    # wall time of every round (the first counted from the end of setup): the walls cover every round's own
    # time (rounds overlap with the next one's reporting, so a single wall may be shorter than its round)
    walls = result.history["wall_seconds"]
    assert walls.notna().all() and (walls > 0).all() and walls.sum() >= result.history["round_seconds"].sum()
    # clients: one row per client, its results first, then its split sizes; no group column without groups
    assert sorted(result.clients["client"]) == [0, 1, 2]
    assert list(result.clients.columns[:8]) == ["client", "test_acc", "test_loss", "val_acc", "val_loss", "n_train",
                                                "n_val", "n_test"]
    assert "group" not in result.clients
    assert result.clients["test_acc"].mean() == pytest.approx(result.final["test_acc_mean"])
    # the MLflow run exists and is finished; its steps, results/final.json and results/rounds.csv count rounds
    # as history does, and per_client.csv is the clients table
    import json

    import pandas as pd
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "api"
    assert [m.step for m in client.get_metric_history(result.run_id, "test_acc_mean")] == list(result.history["round"])
    final = json.loads(open(client.download_artifacts(result.run_id, "results/final.json")).read())
    assert final["round"] == n and final["stage"] == "update" and "step" not in final
    rounds = pd.read_csv(client.download_artifacts(result.run_id, "results/rounds.csv"))
    assert list(rounds["round"]) == list(result.history["round"]) and "step" not in rounds
    per_client = pd.read_csv(client.download_artifacts(result.run_id, "results/per_client.csv"))
    assert list(per_client.columns) == list(result.clients.columns)
    # the headline curves again, named so that the model-metrics tab opens on them (mean, worst, bottom 10%)
    names = ["accuracy/test mean", "accuracy/test worst", "accuracy/test worst 10pct"]
    assert sorted(names) == names
    for name, key in zip(names, ("test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean")):
        assert [m.value for m in client.get_metric_history(result.run_id, name)] == list(result.history[key])
    # the partition report and FedFomo's P at a few rounds as one figure, beside the .npy of every round
    arts = {a.path for d in ("results", "plots") for a in client.list_artifacts(result.run_id, d)}
    assert {"results/partition.csv", "plots/partition.png", "plots/P_rounds.png"} <= arts
    partition = pd.read_csv(client.download_artifacts(result.run_id, "results/partition.csv"))
    assert list(partition["n_train"]) == list(result.clients["n_train"])
    assert result.mlflow_url.endswith(f"/runs/{result.run_id}?workflowType=machine_learning")
    # progress: the plan, how many actors are up, then each round
    kinds = [e["event"] for e in events]
    assert kinds[0] == "plan" and kinds[-1] == "done" and kinds.count("round") == n
    actors = [e for e in events if e["event"] == "actors"]
    assert actors[0]["ready"] == 0 and 1 <= actors[-1]["ready"] == actors[-1]["total"] <= 3  # actors, not clients
    assert kinds.index("actors") < kinds.index("round")


def test_run_tags_and_metric_names(ray_session, mlflow_uri, tmp_path):
    """Provenance tags, the one-line description and the summary metric names, read back from MLflow."""
    from mlflow import MlflowClient

    from rayfl.provenance import version

    result = rayfl.run(algo="fedavg", **TINY, tracking_uri=mlflow_uri, out_dir=str(tmp_path / "runs"),
                       progress=False)
    tags = MlflowClient(mlflow_uri).get_run(result.run_id).data.tags
    assert tags["rayfl.version"] == version()
    assert tags["rayfl.algo"] == "fedavg" and tags["rayfl.dataset"] == "synthetic"
    assert tags["rayfl.command"].startswith("rayfl.run(algo='fedavg', dataset='synthetic'")
    assert tags["mlflow.source.name"] == "rayfl"
    # the description, the top of the run's Overview: one line with the answer (what MLflow's fold is sure to
    # show), the final round's results as a table, then the setting and the partition report
    note = tags["mlflow.note.content"]
    first, blank, head, rule, test_row, val_row = note.splitlines()[:6]
    assert first == (f"**test accuracy {result.final['test_acc_mean']:.2%}** · worst client "
                     f"{result.final['test_acc_worst']:.2%} · bottom 10% {result.final['test_acc_bottom10_mean']:.2%}"
                     " — fedavg on synthetic (iid), 3 clients") and blank == ""
    assert len(first) <= 160
    assert head.startswith("| final round 3 of 3 (train) &emsp; | mean &emsp; | worst client &emsp; | bottom 10%")
    assert test_row == "| test accuracy | " + " | ".join(
        f"**{result.final[f'test_acc_{s}']:.2%}**" for s in ("mean", "worst", "bottom10_mean")) + " |"
    assert val_row.startswith("| validation accuracy | ")
    assert "\nfedavg on synthetic (iid), 3 clients, 3 rounds, participation 1, seed 0\n" in note
    assert "Partition: 3 clients; training samples min 36 / median 36 / max 36; classes per client" in note
    commit = subprocess.run(["git", "-C", os.path.dirname(rayfl.__file__), "rev-parse", "HEAD"],
                            capture_output=True, text=True)
    if commit.returncode == 0:  # run from a checkout
        assert tags["mlflow.source.git.commit"] == commit.stdout.strip()
        assert tags["rayfl.git_commit"].removesuffix("-dirty") == commit.stdout.strip()
    metrics = MlflowClient(mlflow_uri).get_run(result.run_id).data.metrics
    for stat in ("mean", "weighted_mean", "std", "worst", "bottom10_mean"):
        assert f"test_acc_{stat}" in metrics and f"val_acc_{stat}" in metrics
    assert metrics["test_acc_mean"] == pytest.approx(result.final["test_acc_mean"])
    # per-client values are tables by default, not metrics: MLflow 3 would show their prefixed sections first
    assert not any(k.startswith("client/") for k in metrics)


def test_tune_a_two_point_grid(ray_session, mlflow_uri, tmp_path):
    sweep = rayfl.tune(algo="fedavg", space={"grid": {"local_epochs": [1, 2]}}, **{**TINY, "rounds": 2},
                       tracking_uri=mlflow_uri, out_dir=str(tmp_path / "runs"), name="grid2", progress=False)
    assert len(sweep.table) == 2 and sorted(sweep.table["local_epochs"]) == [1, 2]
    assert (sweep.table["status"] == "DONE").all()
    assert sweep.table["val_acc_mean"].is_monotonic_decreasing  # best first
    assert sweep.best == {"local_epochs": sweep.table.iloc[0]["local_epochs"],
                          "val_acc_mean": sweep.table.iloc[0]["val_acc_mean"]}  # the knobs and the metric
    assert sweep.mlflow_url.endswith(f"/runs/{sweep.parent_run_id}?workflowType=machine_learning")
    assert len(repr(sweep).splitlines()) == 2 and "best local_epochs=" in repr(sweep)
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    assert client.get_run(sweep.parent_run_id).info.run_name == "grid2"
    children = client.search_runs([sweep.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{sweep.parent_run_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(sweep.table["mlflow_run_id"])
    assert all(r.data.tags["rayfl.algo"] == "fedavg" for r in children)


def test_console_progress_plain_lines_wall_time_and_eta():
    """On a pipe: plain lines, no carriage returns; wall time between driver times; ETA at their mean."""
    from rayfl.progress import ConsoleProgress

    out = io.StringIO()
    show = ConsoleProgress(out, tty=False)
    show({"event": "actors", "ready": 0, "total": 2})
    show({"event": "actors", "ready": 1, "total": 2})  # within 10 s of the last line: not repeated
    show({"event": "actors", "ready": 2, "total": 2})
    show({"event": "setup", "time": 100.0})
    metrics = {"round_seconds": 0.1, "test_acc_mean": 0.5, "test_acc_worst": 0.25}
    show({"event": "round", "step": 0, "total": 4, "stage": "train", "metrics": metrics, "time": 101.0})
    show({"event": "round", "step": 1, "total": 4, "stage": "train", "metrics": metrics, "time": 104.0})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("rayfl: client actors ready 0/2") and lines[1].startswith(
        "rayfl: client actors ready 2/2")
    assert lines[2].endswith("1.00s")  # one round timed: no estimate yet
    assert lines[3].endswith("3.00s  eta 0:04")  # 3 s, 2 left at the mean 2 s


def test_the_eta_times_rounds_that_evaluate_apart_from_those_that_do_not():
    """Every 5th round evaluates and takes 10 s, the others 1 s: 16 rounds left of which 3 evaluate."""
    from rayfl.progress import RoundClock

    clock, t, etas = RoundClock(), 0.0, []
    clock.mark(t)
    for step in range(4):  # rounds 1-4 (step 0 evaluates)
        t += 10.0 if step == 0 else 1.0
        etas.append(clock.round({"step": step, "total": 20, "time": t, "evaluated": step == 0,
                                 "evaluated_left": 3})[1])
    assert etas[0] is None  # one round timed
    assert etas[1] == 3 * 10.0 + 15 * 1.0  # 18 left, 3 evaluate: each kind at its own mean
    assert etas[3] == 3 * 10.0 + 13 * 1.0
    # before an evaluated round has been timed, it is estimated at the plain rounds' mean
    fresh = RoundClock()
    fresh.mark(0.0)
    fresh.round({"step": 0, "total": 10, "time": 2.0, "evaluated": False, "evaluated_left": 5})
    assert fresh.round({"step": 1, "total": 10, "time": 6.0, "evaluated": False, "evaluated_left": 1})[1] == 8 * 3.0


def test_console_progress_rewrites_the_actor_line_on_a_terminal():
    from rayfl.progress import ConsoleProgress

    out = io.StringIO()
    show = ConsoleProgress(out, tty=True)
    show({"event": "actors", "ready": 0, "total": 2})
    show({"event": "actors", "ready": 1, "total": 2})
    show({"event": "actors", "ready": 2, "total": 2})
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("ready 2/2 (0s)\n")


def test_landing_url_is_the_model_training_runs_table():
    from rayfl.progress import mlflow_hint, ui_url

    assert ui_url("sqlite:////x/mlflow.db", "7") == \
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_url("http://head:5000/", "7", "abc") == \
        "http://head:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    hint = mlflow_hint("sqlite:////x/mlflow.db", "7")
    assert "mlflow ui --backend-store-uri sqlite:////x/mlflow.db" in hint and "Model training" in hint


def test_console_shows_the_knobs_the_partition_and_the_time_since_the_command_began():
    """The header names the algorithm's knobs; the partition report is a line (and a warning when clients have
    few validation or test samples); a round line counts the time since the command began, start-up included."""
    from conftest import tiny

    from rayfl.experiment import prepare
    from rayfl.progress import ConsoleProgress

    cfg = tiny(algo="fedfomo", params={"M": 2}, clients=4, samples_per_client=20)
    out = io.StringIO()
    show = ConsoleProgress(out, tty=False)
    show({"event": "plan", "cfg": cfg, "prepared": prepare(cfg), "run_dir": "/r"})
    show({"event": "setup", "time": 100.0})
    for step, t in ((0, 101.0), (1, 103.0)):
        show({"event": "round", "step": step, "total": 4, "stage": "train", "time": t,
              "metrics": {"round_seconds": 0.1, "test_acc_mean": 0.5, "test_acc_worst": 0.25}})
    header, partition, warning, line, second = out.getvalue().splitlines()
    assert header.startswith("rayfl: fedfomo (M=2, epsilon=") and "on synthetic (iid), 4 clients" in header
    assert partition == ("rayfl: partition: 4 clients; training samples min 12 / median 12 / max 12; "
                         "classes per client min 8 / median 9 / max 9 (of 10)")
    assert warning.startswith("rayfl: warning: 4 of 4 clients have fewer than 10 validation or test samples")
    assert line.endswith("1.00s  elapsed 0:00")  # one round timed: no estimate yet
    assert second.endswith("2.00s  elapsed 0:00  eta 0:03")  # 2 rounds left at the mean 1.5 s


def _run_result():
    import pandas as pd
    from conftest import tiny

    final = {"round": 21, "stage": "update", "test_acc_mean": 0.81234, "test_acc_worst": 0.3333,
             "test_acc_bottom10_mean": 0.4111, "val_acc_mean": 0.79, "val_acc_worst": 0.5,
             "val_acc_bottom10_mean": 0.5}
    history = pd.DataFrame({"round": range(1, 22), "test_acc_mean": [0.5] * 21})
    clients = pd.DataFrame({"client": range(30), "test_acc": [0.8] * 30})
    return rayfl.RunResult(final, history, clients, "abc123", "/r", "sqlite:////x/mlflow.db", "7",
                           tiny(algo="fedfomo", clients=30))


def test_result_reprs_are_short_and_say_what_ran_and_where():
    import pandas as pd

    r = _run_result()
    text = repr(r)
    assert len(text.splitlines()) == 2  # never a DataFrame dump
    assert text.splitlines()[0] == ("RunResult(fedfomo on synthetic, 30 clients, final round 21: test acc 0.8123 "
                                    "(worst 0.3333, bottom 10% 0.4111))")
    assert r.mlflow_url in text and "21 rounds" in text
    html = r._repr_html_()
    assert f"href='{r.mlflow_url}'" in html and "<td>0.8123</td>" in html and "worst client" in html
    table = pd.DataFrame({"trial": [f"t{i}" for i in range(40)], "lam": [0.5] * 40, "status": ["DONE"] * 40,
                          "val_acc_mean": [0.9] * 40, "mlflow_run_id": ["x"] * 40})
    sweep = rayfl.SweepResult(table, "p1", "/s", {"lam": 0.5, "val_acc_mean": 0.9}, "sqlite:////x/mlflow.db", "7",
                              "val_acc_mean", "persfl")
    assert repr(sweep) == ("SweepResult(persfl sweep, 40 trials (40 done); best lam=0.5 (val_acc_mean 0.9000))\n"
                           "  .table 40 rows; "
                           "http://127.0.0.1:5000/#/experiments/7/runs/p1?workflowType=machine_learning")
    html = sweep._repr_html_()
    assert html.count("<tr") == 1 + 5 and "35 more rows" in html and "mlflow_run_id" not in html


def test_dir_and_help_list_the_public_api_and_every_config_key():
    from rayfl.config import FIELDS

    public = {"run", "tune", "compare", "RunResult", "SweepResult", "CompareResult", "SweepFailed", "UserError", "Diverged",
              "Config", "__version__", "register_algorithm", "register_dataset", "DatasetSource", "register_model",
              "ModelSource", "sync", "shutdown"}
    assert public <= set(dir(rayfl))
    assert not {k for k in dir(rayfl) if not k.startswith("__")} - public  # nothing private
    for name in ("RunResult", "SweepResult", "run", "tune"):
        assert getattr(rayfl, name).__doc__
    doc = rayfl.run.__doc__
    for name, f in FIELDS.items():  # generated from the Config: every key with its default
        default = f.default_factory() if f.default_factory is not __import__("dataclasses").MISSING else f.default
        assert f"        {name} = {default!r}: " in doc, name
    assert "        clients = 10: number of clients" in rayfl.tune.__doc__


def test_a_mistyped_key_or_flag_names_the_nearest(capsys, tmp_path):
    from rayfl.cli import main

    with pytest.raises(rayfl.UserError, match=r"unknown config key 'client' \(did you mean 'clients'\?\)"):
        rayfl.run(client=3, progress=False)
    with pytest.raises(rayfl.UserError, match=r"unknown config key 'rouns' \(did you mean 'rounds'\?\)"):
        rayfl.tune(algo="fedavg", rouns=3, progress=False)
    for argv, hint in ((["run", "--client", "3"], "(did you mean --clients?)"),  # not an abbreviation of it
                       (["tune", "--serach", "grid"], "(did you mean --search?)"),
                       (["rn"], "(did you mean 'run'?)")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(hint), err


def test_help_says_each_default_once(capsys):
    from rayfl.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default 0: the run page opens on the summary) (default" not in text
    assert text.count("default 0: the run page opens on the summary") == 1
    assert "--clients N number of clients (default: 10)" in text
