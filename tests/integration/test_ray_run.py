"""Integration on a private local Ray: each baseline runs in client actors, learns, matches the
in-process runtime exactly, and leaves a complete MLflow run behind."""

from __future__ import annotations

import json

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from conftest import tiny
from test_faults import ALGOS  # small settings under which every algorithm runs all of its stages
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime
from rayfl.tracking import ensure_experiment


def launch_tiny(cfg, uri, run_name, **kw):
    from rayfl.actors.launch import launch

    exp = ensure_experiment(uri, "tests")
    seen = []
    result = launch(prepare(cfg), {"tracking_uri": uri, "experiment_id": exp, "run_name": run_name},
                    on_round=seen.append, **kw)
    return result, seen


@pytest.mark.parametrize("algo", ["local", "fedavg", "fedavg-ft"])
def test_baseline_on_ray_learns_and_is_tracked(ray_session, mlflow_uri, algo):
    cfg = tiny(algo=algo, rounds=3, clients=3, samples_per_client=80, local_epochs=5, clients_per_actor=2,
               client_metrics=100)
    result, seen = launch_tiny(cfg, mlflow_uri, f"t-{algo}")
    n_rounds = 3 + (algo == "fedavg-ft")
    assert [r["step"] for r in seen] == list(range(n_rounds))  # progress arrives round by round
    assert result["final"]["test_acc_mean"] > 0.5

    client = MlflowClient(mlflow_uri)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["algo"] == algo and p["clients"] == "3" and p["rounds"] == "3" and p["val_frac"] == "0.2"
    assert p["model_resolved"] == "mlp-small" and p["n_actors"] == "2"
    history = client.get_metric_history(run.info.run_id, "test_acc_mean")
    assert [m.step for m in history] == list(range(1, n_rounds + 1))  # rounds from 1, as on the console
    assert len(client.get_metric_history(run.info.run_id, "client/2/test_acc")) == n_rounds
    for key in ("test_acc_weighted_mean", "test_acc_std", "test_acc_worst", "test_acc_bottom10_mean",
                "test_loss_mean", "val_acc_mean"):
        assert key in run.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    nested = {a.path for d in ("results", "models", "plots", "results/clients")
              for a in client.list_artifacts(run.info.run_id, d)}
    assert {"config.yaml", "placement.json"} <= artifacts
    assert {"results/per_client.csv", "results/rounds.csv", "plots/accuracy.png"} <= nested
    assert {f"results/clients/round_{r:04d}.csv" for r in range(1, n_rounds + 1)} <= nested  # one table a round
    assert ("models/global.npy" in nested) == (algo != "local")
    assert ("models/clients.npz" in nested) == (algo != "fedavg")  # FedAvg's clients keep no model of their own
    placement = json.loads(open(client.download_artifacts(run.info.run_id, "placement.json")).read())["placement"]
    assert sorted(c for a in placement for c in a["clients"]) == [0, 1, 2]
    # the final summary is a JSON artifact, not a second set of one-point metrics cluttering the run page
    final = json.loads(open(client.download_artifacts(run.info.run_id, "results/final.json")).read())
    assert final["test_acc_mean"] == pytest.approx(result["final"]["test_acc_mean"])
    assert not any(k.startswith("final_") for k in run.data.metrics)


def test_ray_matches_in_process_runtime(ray_session, mlflow_uri):
    cfg = tiny(algo="fedavg", rounds=2, clients=3, participation=0.67)
    p = prepare(cfg)
    local = Loop(p, LocalRuntime(p)).run().history
    result, _ = launch_tiny(cfg, mlflow_uri, "same")
    for a, b in zip(local, result["history"]):
        assert a["test_acc_mean"] == b["test_acc_mean"]
        assert a["test_loss_mean"] == pytest.approx(b["test_loss_mean"], rel=1e-6)


class Interrupt(Exception):
    pass


def test_interrupted_run_keeps_its_rounds_and_resumes(ray_session, mlflow_uri, tmp_path):
    """Ctrl-C after round 1: the MLflow run is closed as KILLED with rounds 0-1 kept; resuming from the
    checkpoint finishes the same MLflow run, and the result equals an uninterrupted run."""
    cfg = tiny(algo="fedavg", rounds=4, checkpoint_every=1)

    def interrupt(rec):
        if rec["step"] == 1:
            raise Interrupt()

    exp = ensure_experiment(mlflow_uri, "tests")
    from rayfl.actors.launch import launch

    tracking = {"tracking_uri": mlflow_uri, "experiment_id": exp, "run_name": "interrupted"}
    with pytest.raises(Interrupt):
        launch(prepare(cfg), tracking, checkpoint_dir=str(tmp_path), on_round=interrupt, poll_seconds=0.01)
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([exp], "attributes.run_name = 'interrupted'")[0]
    assert run.info.status == "KILLED"
    kept = [m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")]
    assert kept[:2] == [1, 2] and len(kept) < 4

    result = launch(prepare(cfg), tracking, checkpoint_dir=str(tmp_path))
    assert result["run_id"] == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")]
    assert sorted(set(steps)) == [1, 2, 3, 4]
    p = prepare(cfg)
    uninterrupted = Loop(p, LocalRuntime(p)).run().history
    assert [h["test_acc_mean"] for h in result["history"]] == [h["test_acc_mean"] for h in uninterrupted]


def test_every_algorithm_runs_in_client_actors(ray_session, mlflow_uri):
    """Each registered algorithm completes on Ray, with several clients per actor (so model handles are
    routed between actors and within one), every round as in one process; and its MLflow run, made by the
    same tracker the driver actor runs (here in process: a tracked Ray run costs 1.5-2.5 s more a launch, and
    other tests track on Ray), ends FINISHED with every round's metrics."""
    from rayfl.actors.launch import launch
    from rayfl.algorithms import algorithm_names
    from rayfl.inprocess import run_in_process

    from rayfl.actors.pool import ActorPool

    client = MlflowClient(mlflow_uri)
    assert set(algorithm_names()) == set(ALGOS)  # every registered algorithm has its small settings
    exp = ensure_experiment(mlflow_uri, "tests")
    pool = ActorPool()  # the actors of one algorithm's run serve the next where the shape matches (as rayfl.run's)
    try:
        for algo in algorithm_names():
            cfg = tiny(algo=algo, clients=4, rounds=2, clients_per_actor=2, **ALGOS[algo])
            on_ray = launch(prepare(cfg), None, pool=pool)
            tracked = run_in_process(prepare(cfg), {"tracking_uri": mlflow_uri, "experiment_id": exp,
                                                    "run_name": f"all-{algo}"})
            assert len(on_ray["history"]) == len(tracked["history"]) > 0, algo
            for a, b in zip(on_ray["history"], tracked["history"]):
                assert a["test_acc_mean"] == pytest.approx(b["test_acc_mean"], rel=1e-5, abs=1e-7), algo
            run = client.get_run(tracked["run_id"])
            assert run.info.status == "FINISHED", algo
            assert run.data.metrics["test_acc_mean"] == pytest.approx(tracked["history"][-1]["test_acc_mean"]), algo
            assert len(client.get_metric_history(run.info.run_id, "test_acc_mean")) == len(tracked["history"]), algo
    finally:
        pool.close()
