"""The MLflow run id travels as a return value: the tracker tells whoever submitted the run (``on_run``) before
the first round and writes no file; the submitter records it in the run directory it owns, and a run resumed
from that directory's checkpoint goes on in the same MLflow run."""

from __future__ import annotations

import os

from mlflow.tracking import MlflowClient

from conftest import tiny
from rayfl.experiment import prepare
from rayfl.inprocess import run_in_process
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime
from rayfl.tracking import MlflowTracker
from rayfl.tracking.runs import RUN_ID_FILE, recorded_run_id, resumed_tracking


def test_the_tracker_returns_its_run_id_before_the_first_round_and_writes_no_file(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = prepare(tiny(algo="fedavg", rounds=2, checkpoint_every=1))
    run_dir = tmp_path / "run"
    told = []
    tracker = MlflowTracker(uri, experiment="t")
    loop = Loop(p, LocalRuntime(p), [tracker], str(run_dir))
    tracker.on_run = lambda run_id: told.append((run_id, len(loop.history)))
    loop.run()
    assert told == [(tracker.run_id, 0)]  # once, before any round was recorded
    assert not (run_dir / RUN_ID_FILE).exists()  # the tracker writes no file: the id is a return value


def test_the_submitter_records_the_run_id_and_a_resume_goes_on_in_that_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = str(tmp_path / "run")
    tracking = {"tracking_uri": uri, "experiment": "t", "run_name": "r"}
    assert resumed_tracking(tracking, run_dir) is tracking  # nothing to go on from yet
    first = run_in_process(prepare(tiny(algo="fedavg", rounds=2, checkpoint_every=1)), tracking, run_dir)
    assert recorded_run_id(run_dir) == first["run_id"] and Loop.has_checkpoint(run_dir)
    assert resumed_tracking(tracking, run_dir) == {**tracking, "run_id": first["run_id"]}
    again = run_in_process(prepare(tiny(algo="fedavg", rounds=2, checkpoint_every=1)), tracking, run_dir)
    assert again["run_id"] == first["run_id"]  # the same MLflow run, reopened from its last checkpoint
    client = MlflowClient(uri)
    assert sorted(m.step for m in client.get_metric_history(first["run_id"], "participants")) == [1, 2]  # once each
    assert len(client.search_runs([client.get_run(first["run_id"]).info.experiment_id])) == 1
    os.remove(os.path.join(run_dir, RUN_ID_FILE))  # no record: a checkpoint alone does not name a run
    assert resumed_tracking(tracking, run_dir) is tracking
