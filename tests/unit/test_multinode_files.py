"""On a cluster of several machines the files of a run stay together: a tracking store kept in a file is
refused in one line (the head's server instead), a sweep's or comparison's folder defaults to the folder every
node shares or is refused naming the flag, and a sqlite store's artifacts go beside its database, whatever the
working directory of the process that creates the experiment."""

from __future__ import annotations

import os

import pytest

from rayfl.multinode import SHARED_ENV, check_store, is_file_store, on_cluster, shared_default
from rayfl.user_input import UserError


@pytest.mark.parametrize("uri", ["sqlite:////home/u/mlflow.db", "/home/u/mlruns", "file:///home/u/mlruns"])
def test_a_file_store_is_refused_on_several_machines_only(uri):
    assert is_file_store(uri)
    check_store(uri, n=1)
    with pytest.raises(UserError) as e:
        check_store(uri, n=3)
    msg = str(e.value)
    assert msg.startswith(f"tracking_uri={uri!r}: a file store that only one of this cluster's 3 machines sees")
    assert "head's MLflow server" in msg and "\n" not in msg
    check_store("http://10.0.0.10:5000", n=3)


def test_the_shared_folder_is_the_default_on_several_machines(monkeypatch):
    monkeypatch.setenv(SHARED_ENV, "/mnt/shared/rayfl")
    assert shared_default("--storage-path", "/given", "tune", n=3) == "/given"
    assert shared_default("--storage-path", None, "tune", n=1) is None
    assert shared_default("--storage-path", None, "tune", n=3) == "/mnt/shared/rayfl/tune"
    monkeypatch.delenv(SHARED_ENV)
    with pytest.raises(UserError, match=r"^storage_path=None: this cluster spans 2 machines.*give --storage-path "
                                        r"a folder every node shares"):
        shared_default("--storage-path", None, "tune", n=2)


def test_on_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not on_cluster(None) and not on_cluster("local") and on_cluster("10.0.0.10:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.10:6379")
    assert on_cluster(None)


def test_a_sqlite_store_keeps_artifacts_beside_its_database(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from rayfl.tracking import ensure_experiment

    store = tmp_path / "store"
    store.mkdir()
    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # as a Ray worker whose working directory is not the user's
    uri = f"sqlite:///{store}/mlflow.db"
    exp_id = ensure_experiment(uri, "files")
    client = MlflowClient(uri)
    location = client.get_experiment(exp_id).artifact_location
    assert location.replace("file://", "").rstrip("/") == str(store / "mlruns")
    run = client.create_run(exp_id)
    src = tmp_path / "a.txt"
    src.write_text("x")
    client.log_artifact(run.info.run_id, str(src))
    assert list((store / "mlruns").rglob("a.txt")) and not os.listdir(elsewhere)


def test_only_a_launcher_config_with_room_for_more_workers_can_grow(tmp_path):
    """Lost actors wait for room (capacity_wait) only where an autoscaler can add a node: a cloud provider's
    config with max_workers above the workers up; a fixed on-premises list (provider local) cannot grow."""
    from rayfl.multinode import can_grow

    path = tmp_path / "ray_bootstrap_config.yaml"
    assert not can_grow(str(path))  # no launcher config here (a run submitted from elsewhere)
    path.write_text("provider: {type: local, head_ip: 10.0.0.10, worker_ips: [10.0.0.11]}\nmax_workers: 1\n")
    assert not can_grow(str(path))
    path.write_text("provider: {type: aws}\nmax_workers: 6\n")
    assert can_grow(str(path))
    path.write_text("provider: {type: aws}\nmax_workers: 0\n")
    assert not can_grow(str(path))


def test_a_capacity_wait_the_user_set_waits_for_room():
    from rayfl.actors.launch import _waits_for_room
    from rayfl.config import make_config

    assert not _waits_for_room(make_config(None, {}), cluster_may_grow=False)
    assert _waits_for_room(make_config(None, {"capacity_wait": 30}), cluster_may_grow=False)
