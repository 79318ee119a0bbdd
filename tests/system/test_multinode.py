"""A real multi-node Ray cluster on this one machine, an experiment submitted as a Ray job.

A head (1 CPU, no GPU, dashboard on a private port) and two worker nodes (2 CPUs and 2 *logical*
GPUs each: a GPU-less machine accepts ``num_gpus``, and Ray still hands out GPU ids and sets
CUDA_VISIBLE_DEVICES) are separate raylets started with ``ray.cluster_utils.Cluster``. As on the
cloud cluster (cluster/cluster.yaml), the run goes through the real job-submission path (the
`ray job submit` CLI against the head's dashboard), with Ray token authentication on, and the MLflow
store is named only in the nodes' environment (MLFLOW_TRACKING_URI at node start), not in the job's
command line. The test then checks, from what the run logged to MLflow, that the client actors landed
on more than one node, only on the GPU nodes, each with a GPU id, and that the run holds its metrics.

Isolation on a shared machine:
- The cluster lives in a helper process in its own session, with its own RAY_TMPDIR (Cluster writes
  ``ray_current_cluster`` into the default temp dir, which would capture other people's plain
  ``ray.init()``), its own free ports and its own token (no ~/.ray/auth_token is written).
- Teardown, also on failure: the helper's ``Cluster.shutdown()``; then SIGTERM/SIGKILL to the helper's
  process group; then any process left whose command line or environment names this test's private
  directory (a job entrypoint runs in a session of its own) is killed by pid. Never `ray stop`.
- No ``--working-dir``: with two raylets sharing one session dir the job's extracted working dir can
  be deleted under the running entrypoint (see notes). rayfl is importable from the venv, and the
  nodes' PYTHONPATH names the checkout as well, as the cluster's nodes have rayfl installed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from multinode_cluster import LocalCluster, free_port, isolated_env, kill_leftovers, private_root, remove_root

CLIENTS = 4
ROUNDS = 2
CPUS_PER_ACTOR = 0.9  # two actors fit a 2-CPU worker, a third does not: the clients must use both workers
GPUS_PER_ACTOR = 0.5
WORKER_CPUS, WORKER_GPUS = 2, 2
EXPERIMENT = "multinode"
# About 35-55 s on two idle cores; the margin is for a machine shared with other people's Ray clusters.
JOB_TIMEOUT = 180


def _rayfl_command() -> list[str]:
    script = Path(sys.executable).with_name("rayfl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rayfl.cli"]


def _ray_cli() -> str:
    script = Path(sys.executable).with_name("ray")
    return str(script) if script.exists() else "ray"


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without a token is an answer)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")
            time.sleep(0.5)


@pytest.fixture
def cluster():
    """A head and two GPU worker nodes; yields what the test needs to submit a job and find nodes."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/proc) for the process bookkeeping")
    root = private_root("rfl-mn-")
    token = secrets.token_hex(32)
    env = isolated_env(root, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    # As cluster/cluster.yaml does at `ray start`: the nodes' environment names the tracking store, and
    # every Ray process (the job entrypoint too) inherits it. The `ray job submit` client does not have it.
    tracking_uri = f"sqlite:///{root}/mlflow.db"
    node_env = {**env, "MLFLOW_TRACKING_URI": tracking_uri}
    dashboard_port, agent_port = free_port(), free_port()
    helper = None
    try:
        try:
            helper = LocalCluster(root, node_env, head=dict(
                num_cpus=1, num_gpus=0, include_dashboard=True, dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port, dashboard_agent_listen_port=agent_port),
                workers=[dict(num_cpus=WORKER_CPUS, num_gpus=WORKER_GPUS)] * 2, start_timeout=75)
        except RuntimeError as e:
            pytest.fail(str(e))
        dashboard = f"http://127.0.0.1:{dashboard_port}"
        _wait_http(f"{dashboard}/api/version", timeout=30)
        yield {"root": root, "env": env, "dashboard": dashboard, "tracking_uri": tracking_uri,
               "head": helper.info["head"], "workers": helper.info["workers"], "gcs": helper.info["gcs"]}
    finally:
        left = helper.close() if helper is not None else kill_leftovers(root)[1]
        remove_root(root)
        assert not left, f"processes survived teardown: {left}"


def test_job_on_multinode_cluster_spreads_gpu_client_actors(cluster):
    root, env = cluster["root"], cluster["env"]
    uri = cluster["tracking_uri"]  # not passed to the job: it must come from the nodes' environment
    entrypoint = [*_rayfl_command(), "run",
                  "--dataset", "synthetic", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
                  "--samples-per-client", "60", "--gpus-per-actor", str(GPUS_PER_ACTOR),
                  "--cpus-per-actor", str(CPUS_PER_ACTOR), "--experiment", EXPERIMENT,
                  "--out-dir", f"{root}/runs", "--client-metrics", "100"]
    submission_id = f"rayfl-multinode-{secrets.token_hex(4)}"
    # No runtime_env: the nodes' environment already has what the job needs (PYTHONPATH, the tracking
    # URI), and a job without one can use the workers its raylets pre-started (a runtime_env would
    # need fresh worker processes).
    cmd = [_ray_cli(), "job", "submit", "--address", cluster["dashboard"], "--submission-id", submission_id,
           "--", *entrypoint]
    t0, wall0 = time.monotonic(), time.time()
    try:
        job = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        subprocess.run([_ray_cli(), "job", "stop", "--address", cluster["dashboard"], submission_id],
                       env=env, capture_output=True, timeout=20)
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the job did not finish in {e.timeout}s:\n{partial[-4000:]}")
    elapsed = time.monotonic() - t0
    out = job.stdout + job.stderr
    assert job.returncode == 0, f"`ray job submit` failed ({job.returncode}):\n{out[-6000:]}"
    assert "succeeded" in out.lower(), out[-4000:]
    print(f"job {submission_id}: {elapsed:.1f}s end to end")

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"no MLflow experiment {EXPERIMENT!r} in {uri}"
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"

    # Metrics: one value per round for the per-round means, final-round summaries.
    for key in ("test_acc_mean", "test_loss_mean"):
        history = client.get_metric_history(run.info.run_id, key)
        assert len(history) == ROUNDS, f"{key}: {len(history)} steps, expected {ROUNDS}"
        assert sorted(m.step for m in history) == list(range(1, ROUNDS + 1))
    os.makedirs(f"{root}/final", exist_ok=True)
    with open(client.download_artifacts(run.info.run_id, "results/final.json", f"{root}/final")) as f:
        assert "test_acc_mean" in json.load(f)
    first = min(m.timestamp for m in client.get_metric_history(run.info.run_id, "test_acc_mean")) / 1000
    print(f"timeline (s after submit): run start {run.info.start_time / 1000 - wall0:.1f}, "
          f"first round logged {first - wall0:.1f}, run end {run.info.end_time / 1000 - wall0:.1f}, "
          f"job done {elapsed:.1f}")
    assert any(k.startswith("client/") for k in run.data.metrics)

    # Where the client actors ran (placement.json, written by the core at the start of the run).
    os.makedirs(f"{root}/dl", exist_ok=True)
    with open(client.download_artifacts(run.info.run_id, "placement.json", f"{root}/dl")) as f:
        placement = json.load(f)
    placement = placement["placement"] if isinstance(placement, dict) else placement
    assert len(placement) == CLIENTS  # one client per actor by default
    assert sorted(c for a in placement for c in a["clients"]) == list(range(CLIENTS))
    nodes = {a["node_id"] for a in placement}
    workers = set(cluster["workers"])
    assert len(nodes) >= 2, f"all client actors on one node: {placement}"
    assert nodes <= workers, f"client actors off the GPU worker nodes ({cluster['head']} is the head)"
    for a in placement:
        assert a["gpu_ids"], f"actor {a['actor']} asked for {GPUS_PER_ACTOR} GPU and got no GPU id: {a}"
        assert all(0 <= int(g) < WORKER_GPUS for g in a["gpu_ids"]), a
        if "cuda_visible_devices" in a:
            assert a["cuda_visible_devices"] == ",".join(map(str, a["gpu_ids"])), a
        if "num_gpus" in a:
            assert a["num_gpus"] == GPUS_PER_ACTOR
    assert run.data.params.get("gpus_per_actor") in (str(GPUS_PER_ACTOR), f"{GPUS_PER_ACTOR:g}")
