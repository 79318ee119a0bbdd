"""The Python API: rayfl.run returns final/history/clients/run_id; rayfl.tune a results table and the parent
run; a user mistake raises rayfl.UserError before Ray starts; the run's MLflow tags and metric names;
``rayfl --version``; importing rayfl loads no torch, Ray or MLflow; round wall times and the ETA."""

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
    # from 1, the final row equal to .final
    n = len(result.history)
    assert n >= TINY["rounds"] and list(result.history["round"]) == list(range(1, n + 1))
    assert result.history.iloc[-1]["test_acc_mean"] == result.final["test_acc_mean"]
    # wall time of every round (the first counted from the end of setup): the walls cover every round's own
    # time (rounds overlap with the next one's reporting, so a single wall may be shorter than its round)
    walls = result.history["wall_seconds"]
    assert walls.notna().all() and (walls > 0).all() and walls.sum() >= result.history["round_seconds"].sum()
    # clients: one row per client with its evaluation
    assert sorted(result.clients["client"]) == [0, 1, 2]
    assert {"n_train", "test_acc"} <= set(result.clients.columns)
    assert result.clients["test_acc"].mean() == pytest.approx(result.final["test_acc_mean"])
    # the MLflow run exists and is finished
    from mlflow import MlflowClient

    run = MlflowClient(mlflow_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "api"
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
    assert tags["mlflow.note.content"] == ("fedavg on synthetic (iid), 3 clients, 3 rounds, participation 1, "
                                           "seed 0")
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
    assert sweep.best == {"local_epochs": sweep.table.iloc[0]["local_epochs"]}
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
    assert lines[2].endswith("1.00s  eta 0:03")  # 1 s, 3 rounds left at 1 s
    assert lines[3].endswith("3.00s  eta 0:04")  # 3 s, 2 left at the mean 2 s


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
