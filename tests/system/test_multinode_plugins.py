"""A plugin that exists only where the run is submitted, run on a real multi-node Ray cluster on this machine.

The plugin (an algorithm, a dataset and a model in one file) is written to a temporary directory that is on no
node's ``PYTHONPATH``; the nodes have rayfl installed, as a cluster's nodes do. Two ways in:

- ``ray job submit --working-dir DIR -- rayfl run --plugin my_plugin.py``: Ray uploads DIR, the entrypoint
  runs there and finds the file by its relative path;
- ``rayfl run --address GCS --plugin my_plugin`` (a module name, importable in the submitting process only,
  through its PYTHONPATH).

Either way the plugin's module reaches the driver and client actors pickled by value (rayfl.plugins.carried);
nothing is shipped for it in a runtime_env (``py_modules``), which these runs show is not needed.

Two raylets on one machine share a session directory, and with it the runtime-env agents' package directory
(``runtime_resources``): the worker node's agent, installing the job's working_dir, deleted and re-extracted the
package the entrypoint runs in (its cwd vanished: FileNotFoundError). Each node here gets its own
``runtime_env_dir_name``, as each machine of a real cluster has its own disk.

A plugin that imports a helper module from its own folder loads (the folder is importable where the plugin is
loaded) and runs on the workers, which do not have that folder (the helper travels by value with the plugin); a
module the plugin imports from elsewhere that the nodes lack is one line naming it, with no actor restarted.

Each run must finish with its client actors on the worker nodes (the head has no GPU; the actors ask for one)
and its MLflow run must hold the plugin algorithm's own metric. The cluster (tests/multinode_cluster.py) is
shared by both tests; isolation and teardown are that module's.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from multinode_cluster import LocalCluster, free_port, isolated_env, kill_leftovers, private_root, remove_root

CLIENTS, ROUNDS, MU = 4, 2, 0.25
CPUS_PER_ACTOR, GPUS_PER_ACTOR = 0.9, 0.5  # two actors per worker node, none on the GPU-less head
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


@pytest.fixture(scope="module")
def cluster():
    """A GPU-less head with the dashboard and two worker nodes with 2 CPUs and 2 logical GPUs each."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/proc) for the process bookkeeping")
    root = private_root("rfl-mp-")
    env = isolated_env(root, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    dashboard_port = free_port()
    helper = None
    try:
        try:
            helper = LocalCluster(root, env, head=dict(
                num_cpus=1, num_gpus=0, include_dashboard=True, dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port, dashboard_agent_listen_port=free_port()),
                workers=[dict(num_cpus=2, num_gpus=2, runtime_env_dir_name=f"runtime_resources_{i}") for i in range(2)],
                start_timeout=75)
        except RuntimeError as e:
            pytest.fail(str(e))
        submit = Path(root) / "submit"  # the user's directory: the plugin is here and nowhere else
        submit.mkdir()
        (submit / "my_plugin.py").write_text(PLUGIN)
        yield {"root": root, "env": env, "dashboard": f"http://127.0.0.1:{dashboard_port}", "submit": submit,
               "gcs": helper.info["gcs"], "head": helper.info["head"], "workers": set(helper.info["workers"])}
    finally:
        left = helper.close() if helper is not None else kill_leftovers(root)[1]
        remove_root(root)
        assert not left, f"processes survived teardown: {left}"


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
