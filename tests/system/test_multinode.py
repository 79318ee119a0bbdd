"""A real multi-node Ray cluster on this one machine: an experiment submitted as a Ray job, and a plugin that
exists only where the run is submitted.

One cluster serves every test here (its start is the costly part of each): a head (1 CPU, no GPU, dashboard on a
private port) and two worker nodes (2 CPUs and 2 *logical* GPUs each: a GPU-less machine accepts ``num_gpus``,
and Ray still hands out GPU ids and sets CUDA_VISIBLE_DEVICES), separate raylets started with
``ray.cluster_utils.Cluster`` (tests/multinode_cluster.py), with Ray token authentication on. Each test uses an
MLflow experiment of its own in the cluster's store, so none depends on another having run.

The job: as on the cloud cluster (cluster/cluster.yaml), the run goes through the real job-submission path (the
`ray job submit` CLI against the head's dashboard), and the MLflow store is named only in the nodes' environment
(MLFLOW_TRACKING_URI at node start), not in the job's command line. The test then checks, from what the run
logged to MLflow, that the client actors landed on more than one node, only on the GPU nodes, each with a GPU
id, and that the run holds its metrics.

The plugin (an algorithm, a dataset and a model in one file) is written to a temporary directory that is on no
node's ``PYTHONPATH``; the nodes have rayfl installed, as a cluster's nodes do. Two ways in:

- ``ray job submit --working-dir DIR -- rayfl run --plugin my_plugin.py``: Ray uploads DIR, the entrypoint
  runs there and finds the file by its relative path;
- ``rayfl run --address GCS --plugin my_plugin`` (a module name, importable in the submitting process only,
  through its PYTHONPATH).

Either way the plugin's module reaches the driver and client actors pickled by value (rayfl.plugins.carried);
nothing is shipped for it in a runtime_env (``py_modules``), which these runs show is not needed.

A plugin that imports a helper module from its own folder loads (the folder is importable where the plugin is
loaded) and runs on the workers, which do not have that folder (the helper travels by value with the plugin); a
module the plugin imports from elsewhere that the nodes lack is one line naming it, with no actor restarted.
Each plugin run must finish with its client actors on the worker nodes (the head has no GPU; the actors ask for
one) and its MLflow run must hold the plugin algorithm's own metric.

Isolation on a shared machine:
- The cluster lives in a helper process in its own session, with its own RAY_TMPDIR (Cluster writes
  ``ray_current_cluster`` into the default temp dir, which would capture other people's plain
  ``ray.init()``), its own free ports and its own token (no ~/.ray/auth_token is written).
- Teardown, also on failure: the helper's ``Cluster.shutdown()``; then SIGTERM/SIGKILL to the helper's
  process group; then any process left whose command line or environment names this module's private
  directory (a job entrypoint runs in a session of its own) is killed by pid. Never `ray stop`.
- The job without ``--working-dir``: with two raylets sharing one session dir the job's extracted working dir
  can be deleted under the running entrypoint (see notes). rayfl is importable from the venv, and the nodes'
  PYTHONPATH names the checkout as well, as the cluster's nodes have rayfl installed.
- Two raylets on one machine share a session directory, and with it the runtime-env agents' package directory
  (``runtime_resources``): the worker node's agent, installing a job's working_dir, deleted and re-extracted the
  package the entrypoint runs in (its cwd vanished: FileNotFoundError). Each node here gets its own
  ``runtime_env_dir_name``, as each machine of a real cluster has its own disk.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from multinode_cluster import LocalCluster, free_port, isolated_env, kill_leftovers, private_root, remove_root

CLIENTS, ROUNDS, MU = 4, 2, 0.25
CPUS_PER_ACTOR = 0.9  # two actors fit a 2-CPU worker, a third does not: the clients must use both workers
GPUS_PER_ACTOR = 0.5
WORKER_CPUS, WORKER_GPUS = 2, 2
EXPERIMENT = "multinode"
# About 35-55 s on two idle cores; the margin is for a machine shared with other people's Ray clusters.
JOB_TIMEOUT = 180
RUN_TIMEOUT = 180

PLUGIN = textwrap.dedent('''
    """A plugin algorithm (FedAvg plus a proximal term), dataset and model, in one file."""
    from dataclasses import dataclass

    import numpy as np
    from torch import nn

    from rayfl import DatasetSource, ModelSource
    from rayfl.algorithms.base import Algorithm
    from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
    from rayfl.training import loss_fn_for


    @dataclass
    class Params:
        mu: float = 0.1

        def check(self, n_clients):
            if not 0 <= self.mu < float("inf"):
                raise ValueError(f"mu={self.mu}: must be a finite number >= 0")


    class Server(FedAvgServer):
        def run_round(self, stage, rnd, participants, call):
            return {**super().run_round(stage, rnd, participants, call), "plugin_mu": self.params.mu}


    class Client(FedAvgClient):
        def local_fit(self, client, model, msg):
            anchor = [p.detach().clone() for p in model.parameters()]
            base, mu = loss_fn_for(client.settings.task), self.params.mu

            def loss_fn(out, y):
                prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
                return base(out, y) + mu / 2 * prox

            return client.fit(model, loss_fn=loss_fn)


    def blobs():
        rng = np.random.default_rng(0)
        y = rng.integers(0, 3, 480)
        return rng.normal(size=(480, 8)).astype("float32") + y[:, None], y


    def mlp(input_shape, num_outputs):
        return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.ReLU(),
                             nn.Linear(16, num_outputs))


    ALGORITHM = Algorithm("my-prox", Params, Server, Client, "FedAvg with a proximal term")
    DATASET = DatasetSource("blobs", blobs)
    MODEL = ModelSource("tiny-mlp", mlp)
''')
N_PARAMS = 8 * 16 + 16 + 16 * 3 + 3  # tiny-mlp on blobs: Linear(8, 16) and Linear(16, 3)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


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


@pytest.fixture(scope="module")
def cluster():
    """A GPU-less head with the dashboard and two worker nodes with 2 CPUs and 2 logical GPUs each, for every test
    of this module; yields what a test needs to submit a job or a run and find nodes."""
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
                workers=[dict(num_cpus=WORKER_CPUS, num_gpus=WORKER_GPUS, runtime_env_dir_name=f"runtime_resources_{i}")
                         for i in range(2)], start_timeout=75)
        except RuntimeError as e:
            pytest.fail(str(e))
        dashboard = f"http://127.0.0.1:{dashboard_port}"
        _wait_http(f"{dashboard}/api/version", timeout=30)
        submit = Path(root) / "submit"  # the user's directory: the plugin is here and nowhere else
        submit.mkdir()
        (submit / "my_plugin.py").write_text(PLUGIN)
        yield {"root": root, "env": env, "dashboard": dashboard, "tracking_uri": tracking_uri, "submit": submit,
               "head": helper.info["head"], "workers": set(helper.info["workers"]), "gcs": helper.info["gcs"]}
    finally:
        left = helper.close() if helper is not None else kill_leftovers(root)[1]
        remove_root(root)
        assert not left, f"processes survived teardown: {left}"


def test_job_on_multinode_cluster_spreads_gpu_client_actors(cluster):
    root, env = cluster["root"], cluster["env"]
    uri = cluster["tracking_uri"]  # not passed to the job: it must come from the nodes' environment
    entrypoint = [_bin("rayfl"), "run",
                  "--dataset", "synthetic", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
                  "--samples-per-client", "60", "--gpus-per-actor", str(GPUS_PER_ACTOR),
                  "--cpus-per-actor", str(CPUS_PER_ACTOR), "--experiment", EXPERIMENT,
                  "--out-dir", f"{root}/runs", "--client-metrics", "100"]
    submission_id = f"rayfl-multinode-{secrets.token_hex(4)}"
    # No runtime_env: the nodes' environment already has what the job needs (PYTHONPATH, the tracking
    # URI), and a job without one can use the workers its raylets pre-started (a runtime_env would
    # need fresh worker processes).
    cmd = [_bin("ray"), "job", "submit", "--address", cluster["dashboard"], "--submission-id", submission_id,
           "--", *entrypoint]
    t0, wall0 = time.monotonic(), time.time()
    try:
        job = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        subprocess.run([_bin("ray"), "job", "stop", "--address", cluster["dashboard"], submission_id],
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


def _run_args(root: str, experiment: str, plugin: str) -> list[str]:
    return ["run", "--plugin", plugin, "--algo", "my-prox", "--dataset", "blobs", "--model", "tiny-mlp",
            "--param", f"mu={MU}", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
            "--cpus-per-actor", str(CPUS_PER_ACTOR), "--gpus-per-actor", str(GPUS_PER_ACTOR),
            "--experiment", experiment, "--tracking-uri", f"sqlite:///{root}/mlflow.db", "--out-dir", f"{root}/runs"]


def _run(cmd: list[str], env: dict, cwd, what: str) -> float:
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{what} did not finish in {e.timeout}s:\n{out[-4000:]}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{out[-6000:]}"
    return time.monotonic() - t0


def _check_run(cluster: dict, experiment: str, logged_mu: float = MU) -> None:
    """The MLflow run finished, holds the plugin's metric every round, used its dataset and model, and its
    client actors ran on the worker nodes (placement.json, written by the run's driver)."""
    from mlflow.tracking import MlflowClient

    root = cluster["root"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    assert (run.data.params["algo"], run.data.params["dataset"], run.data.params["model"]) == (
        "my-prox", "blobs", "tiny-mlp")
    history = client.get_metric_history(run.info.run_id, "plugin_mu")
    assert sorted((m.step, m.value) for m in history) == [(r, logged_mu) for r in range(1, ROUNDS + 1)]
    assert len(client.get_metric_history(run.info.run_id, "test_acc_mean")) == ROUNDS
    dest = Path(root) / "dl" / experiment
    dest.mkdir(parents=True)
    placement = json.loads(Path(client.download_artifacts(run.info.run_id, "placement.json", str(dest))).read_text())
    placement = placement["placement"] if isinstance(placement, dict) else placement
    assert sorted(c for a in placement for c in a["clients"]) == list(range(CLIENTS))
    nodes = {a["node_id"] for a in placement}
    assert nodes <= cluster["workers"] and len(nodes) == 2, f"client actors not on both workers: {placement}"
    assert all(a.get("n_params", N_PARAMS) == N_PARAMS for a in placement), placement


def test_plugin_file_in_a_job_working_dir(cluster):
    """``ray job submit --working-dir``: the plugin given by its path relative to the job's directory."""
    experiment = "plugin-job"
    cmd = [_bin("ray"), "job", "submit", "--address", cluster["dashboard"], "--working-dir", ".",
           "--submission-id", f"rayfl-plugin-{secrets.token_hex(4)}", "--",
           _bin("rayfl"), *_run_args(cluster["root"], experiment, "my_plugin.py")]
    seconds = _run(cmd, cluster["env"], cluster["submit"], "the Ray job")
    print(f"job: {seconds:.1f}s")
    _check_run(cluster, experiment)


def test_plugin_module_not_on_the_nodes(cluster):
    """``rayfl run --address`` from this machine, the plugin a module on this process's PYTHONPATH only (not
    the nodes')."""
    experiment = "plugin-module"
    env = {**cluster["env"], "PYTHONPATH": os.pathsep.join([str(cluster["submit"]), cluster["env"]["PYTHONPATH"]])}
    cmd = [_bin("rayfl"), *_run_args(cluster["root"], experiment, "my_plugin"), "--address", cluster["gcs"]]
    seconds = _run(cmd, env, cluster["root"], "rayfl run --address")
    print(f"rayfl run --address: {seconds:.1f}s")
    _check_run(cluster, experiment)


SIBLING_PLUGIN = PLUGIN.replace("from dataclasses import dataclass", "from dataclasses import dataclass\n\nimport my_helpers").replace(
    '"plugin_mu": self.params.mu}', '"plugin_mu": my_helpers.reported(self.params.mu)}')
HELPERS = "def reported(mu):\n    return 2 * mu\n"


def test_plugin_with_a_sibling_module_from_a_folder_the_workers_do_not_have(cluster):
    """``--plugin /elsewhere/sib_plugin.py``, which imports ``my_helpers`` beside it; neither the submitting
    process's nor the nodes' PYTHONPATH names that folder, and the run is started from another directory."""
    assert "import my_helpers" in SIBLING_PLUGIN and "my_helpers.reported" in SIBLING_PLUGIN
    elsewhere = Path(cluster["root"]) / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "sib_plugin.py").write_text(SIBLING_PLUGIN)
    (elsewhere / "my_helpers.py").write_text(HELPERS)
    experiment = "plugin-sibling"
    cmd = [_bin("rayfl"), *_run_args(cluster["root"], experiment, str(elsewhere / "sib_plugin.py")),
           "--address", cluster["gcs"]]
    seconds = _run(cmd, cluster["env"], cluster["root"], "rayfl run --plugin FILE with a sibling module")
    print(f"sibling module: {seconds:.1f}s")
    _check_run(cluster, experiment, logged_mu=2 * MU)  # the helper's value: it ran on the driver


def test_a_module_missing_on_the_nodes_is_one_line_naming_it_and_no_actor_restarts(cluster):
    """The plugin imports ``far_helper`` from a folder on the submitting process's PYTHONPATH only (not the
    plugin's folder, not the nodes'): the run ends in one line naming the module, exit 2, within seconds and
    without the driver actor being started again."""
    far, home = Path(cluster["root"]) / "far", Path(cluster["root"]) / "home"
    far.mkdir()
    home.mkdir()
    (far / "far_helper.py").write_text(HELPERS)
    (home / "far_plugin.py").write_text(SIBLING_PLUGIN.replace("my_helpers", "far_helper"))
    env = {**cluster["env"], "PYTHONPATH": os.pathsep.join([str(far), cluster["env"]["PYTHONPATH"]])}
    cmd = [_bin("rayfl"), *_run_args(cluster["root"], "plugin-missing", str(home / "far_plugin.py")),
           "--address", cluster["gcs"]]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=cluster["root"], capture_output=True, text=True, timeout=RUN_TIMEOUT)
    said = [line for line in done.stderr.splitlines() if line.startswith("rayfl:")]
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith("rayfl: error: plugin=") and \
        "module 'far_helper' is not importable on node" in said[0], done.stderr[-3000:]
    assert "died" not in done.stderr and time.monotonic() - t0 < 120, done.stderr[-3000:]
