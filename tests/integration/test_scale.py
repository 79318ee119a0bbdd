"""Populations far larger than the machine's cores on a private local Ray, with no placement flag."""

from __future__ import annotations

import json

from mlflow.tracking import MlflowClient

from conftest import random_mnist, tiny
from rayfl.actors.launch import launch
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.tracking import ensure_experiment


def _launch(cfg, uri):
    tracking = {"tracking_uri": uri, "experiment_id": ensure_experiment(uri, "scale"), "run_name": "scale"}
    seen = []
    return launch(prepare(cfg), tracking, on_round=seen.append), seen


def _placement(uri, run_id):
    client = MlflowClient(uri)
    return json.loads(open(client.download_artifacts(run_id, "placement.json")).read())["placement"]


def test_a_hundred_clients_need_no_placement_flag(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = tiny(algo="fedavg", clients=100, samples_per_client=20, rounds=2)
    assert cfg.clients_per_actor == "auto"
    result, seen = _launch(cfg, uri)
    placement = _placement(uri, result["run_id"])
    assert len(placement) == 2  # one actor per CPU of the test's 2-CPU instance
    assert sorted(c for a in placement for c in a["clients"]) == list(range(100))
    assert [len(a["clients"]) for a in placement] == [50, 50]
    assert len(result["per_client"]) == 100 and result["final"]["test_acc_mean"] > 0.1


def test_a_thousand_clients_with_a_tiny_model(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    root = random_mnist(tmp_path / "data", 10_000)
    cfg = make_config(None, {"algo": "fedavg", "dataset": "mnist", "data_root": root, "partition": "iid",
                             "clients": 1000, "samples_per_client": 10, "participation": 0.1, "model": "logreg",
                             "rounds": 2, "lr": 0.05})
    result, seen = _launch(cfg, uri)
    assert [r["participants"] for r in seen] == [100, 100]
    assert len(result["per_client"]) == 1000  # every client evaluated on its own test split
    run = MlflowClient(uri).get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    assert not any(k.startswith("client/") for k in run.data.metrics)  # above client_metrics: tables only
    tables = {a.path for a in MlflowClient(uri).list_artifacts(result["run_id"], "results/clients")}
    assert tables == {"results/clients/round_0001.csv", "results/clients/round_0002.csv"}
