"""A run that goes non-finite stops at that round, says so in one line, ends FAILED, keeps its last finite
checkpoint, and a comparison shows the row as diverged instead of NaN's 10% (rayfl.divergence)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from conftest import tiny
from rayfl.divergence import Diverged, round_problem, step_size_hint

# FedAvg whose global model is made NaN in its second round: a run that diverges at a known round.
PLUGIN = '''
from dataclasses import dataclass

import numpy as np

from rayfl.algorithms.base import Algorithm
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer


@dataclass
class NanParams:
    at: int = 1  # the round (from 0) whose average is made NaN
    inner_lr: float = 0.2  # a step size of the algorithm's own: above 0.15 the model goes NaN at round `at`

    def check(self, n_clients: int) -> None:
        pass


class NanServer(FedAvgServer):
    def run_round(self, stage, rnd, participants, call):
        out = super().run_round(stage, rnd, participants, call)
        if rnd == self.params.at and self.params.inner_lr > 0.15:  # too large a step: NaN
            w = np.array(self.get([self.global_ref])[0])
            w[0] = np.nan
            self.global_ref = self.put(w)
        return out


ALGORITHM = Algorithm("fednan", NanParams, NanServer, FedAvgClient, "FedAvg made NaN at round `at`")
'''

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAYFL = os.path.join(os.path.dirname(sys.executable), "rayfl")


@pytest.fixture(scope="module")
def nan_plugin(tmp_path_factory):
    """The plugin's file (one file: a name is registered from one source); its algorithm is unregistered after
    this module, so that tests over every algorithm elsewhere do not meet it."""
    from rayfl import algorithms, plugins

    path = tmp_path_factory.mktemp("plugin") / "fednan.py"
    path.write_text(PLUGIN)
    yield str(path)
    algorithms._registered.pop("fednan", None)
    plugins._loaded.pop(str(path), None)


def test_round_problem_names_the_split_and_counts_clients():
    ok = {0: {"test_loss": 0.5, "n_test": 4, "val_loss": 0.4, "n_val": 2}}
    assert round_problem({"train_loss": 0.3}, ok) is None
    assert round_problem({"train_loss": float("nan")}, ok) == "train_loss is NaN"
    assert round_problem({"train_loss": float("inf")}, {}) == "train_loss is inf"
    assert round_problem({"train_loss": float("nan")}, ok, participants=0) is None  # nobody sampled, nothing trained
    bad = {0: {"test_loss": float("nan"), "n_test": 4}, 1: {"test_loss": 0.2, "n_test": 4},
           2: {"test_loss": float("nan"), "n_test": 3}}
    assert round_problem({}, bad) == "test loss is NaN for 2 of 3 clients"
    # an empty split's NaN is no divergence
    assert round_problem({}, {0: {"val_loss": float("nan"), "n_val": 0, "test_loss": 1.0, "n_test": 2}}) is None


def test_the_hint_halves_every_step_size():
    from rayfl.algorithms import get_algorithm

    cfg = tiny(algo="pfedme", lr=0.1)
    params = get_algorithm("pfedme").make_params(cfg.params)
    assert step_size_hint(cfg, params) == "lower a step size, e.g. --lr 0.05 or -p personal_lr=0.045"


def test_diverged_crosses_processes_with_its_fields():
    e = pickle.loads(pickle.dumps(Diverged(2, "pfedme", "test loss is NaN for 3 of 3 clients", "lower lr")))
    assert (e.round, e.algo, str(e)) == (2, "pfedme", "run diverged at round 2: pfedme test loss is NaN for 3 of 3 "
                                                      "clients; lower lr")


def test_in_process_the_run_stops_at_that_round_failed_with_its_last_finite_checkpoint(nan_plugin, tmp_path):
    import mlflow

    from rayfl import plugins
    from rayfl.experiment import prepare
    from rayfl.inprocess import run_in_process
    from rayfl.loop import Loop
    from rayfl.tracking import ensure_experiment

    plugins.load_plugins([nan_plugin])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = tiny(algo="fednan", rounds=4, checkpoint_every=1, tracking_uri=uri)
    exp = ensure_experiment(uri, cfg.experiment)
    run_dir = str(tmp_path / "run")
    seen = []
    with pytest.raises(Diverged) as info:
        run_in_process(prepare(cfg), {"tracking_uri": uri, "experiment_id": exp, "run_name": "nan"}, run_dir,
                       on_round=seen.append)
    assert info.value.round == 2
    assert "test loss is NaN for 3 of 3 clients; its global model has NaN or inf weights" in str(info.value)
    assert "-p inner_lr=0.1" in str(info.value)
    assert [e["step"] for e in seen] == [0]  # round 2 is not reported as a result
    state = Loop.read_checkpoint(run_dir, cfg)
    assert state["step"] == 0 and np.isfinite(state["server"]["global"]).all()
    run = mlflow.MlflowClient(uri).search_runs([exp])[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["rayfl.failure"].startswith("run diverged at round 2: fednan test loss is NaN")


def test_a_nan_model_is_never_written_as_a_checkpoint(nan_plugin, tmp_path):
    """Evaluated every other round, the NaN model of round 2 is caught when round 2's checkpoint is due."""
    from rayfl import plugins
    from rayfl.experiment import prepare
    from rayfl.inprocess import run_in_process
    from rayfl.loop import Loop

    plugins.load_plugins([nan_plugin])
    cfg = tiny(algo="fednan", rounds=5, checkpoint_every=1, eval_every=3)
    run_dir = str(tmp_path / "run")
    with pytest.raises(Diverged, match="at round 2: fednan global model has NaN or inf weights"):
        run_in_process(prepare(cfg), None, run_dir)
    assert Loop.read_checkpoint(run_dir, cfg)["step"] == 0


def test_the_command_on_ray_says_one_line_and_exits_1(nan_plugin, tmp_path):
    import mlflow

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYFL_PLUGINS")}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = subprocess.run([RAYFL, "run", "--plugin", nan_plugin, "--algo", "fednan", "--dataset", "synthetic",
                          "--clients", "3", "--rounds", "4", "--samples-per-client", "60", "--checkpoint-every", "1",
                          "--tracking-uri", uri, "--out-dir", str(tmp_path / "runs"), "--quiet"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("rayfl:")]
    assert lines[0].startswith("rayfl: run diverged at round 2: fednan test loss is NaN for 3 of 3 clients")
    run_dir = str(tmp_path / "runs" / os.listdir(tmp_path / "runs")[0])
    assert lines[1] == ("rayfl: its last checkpoint, written before the divergence, is kept; go on from it with a "
                        f"lower step size: rayfl run --resume {run_dir} --lr 0.025")
    assert "Traceback" not in out.stderr and "final round" not in out.stdout
    client = mlflow.MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("rayfl").experiment_id])
    assert run.info.status == "FAILED"

    # a step size that is not lowered is refused; the algorithm's own, lowered, goes on to the end, same run
    base = [RAYFL, "run", "--plugin", nan_plugin, "--resume", run_dir, "--quiet"]
    refused = subprocess.run(base + ["--batch-size", "8"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and refused.stderr.startswith(f"rayfl: error: --resume {run_dir!r} with --batch-size")
    again = subprocess.run(base + ["-p", "inner_lr=0.1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "final round 4" in again.stdout
    [run] = client.search_runs([client.get_experiment_by_name("rayfl").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["rayfl.step_sizes"] == "inner_lr 0.2 -> 0.1 from round 2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accuracy/test mean")] == [1, 2, 3, 4]


def test_the_api_raises_diverged_and_compare_shows_the_row_as_diverged(nan_plugin, tmp_path, ray_session):
    import rayfl

    path = nan_plugin
    common = {"dataset": "synthetic", "clients": 3, "rounds": 3, "samples_per_client": 60,
              "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "out_dir": str(tmp_path / "runs")}
    with pytest.raises(rayfl.Diverged, match="run diverged at round 2"):
        rayfl.run(algo="fednan", plugins=[path], progress=False, **common)
    lines = []
    result = rayfl.compare(["fedavg", "fednan"], seeds=[0], plugins=[path], progress=lines.append, **common)
    table = result.table.set_index("algo")
    assert table.loc["fednan", "diverged"] == "round 2" and table.loc["fednan", "seeds"] == 0
    assert table.loc["fedavg", "diverged"] == "" and table.loc["fedavg", "test_acc_mean"] > 0
    row = next(line for line in result.markdown.splitlines() if line.startswith("| fednan"))
    assert "diverged (round 2)" in row and "%" not in row
    assert any("fednan s0: diverged at round 2" in line for line in lines)


def test_compare_in_process_shows_the_row_as_diverged(nan_plugin, tmp_path):
    import rayfl

    result = rayfl.compare(["fedavg", "fednan"], seeds=[0, 1], plugins=[nan_plugin], runtime="local",
                           dataset="synthetic", clients=3, rounds=3, samples_per_client=60,
                           tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", out_dir=str(tmp_path / "runs"))
    table = result.table.set_index("algo")
    assert table.loc["fednan", "diverged"] == "round 2, 2"
    assert "| fednan | 0 (2 diverged) | diverged (round 2, 2)" in result.markdown


def test_a_model_has_nan_only_when_a_float_weight_is_not_finite():
    from rayfl.divergence import model_has_nan

    assert model_has_nan(np.array([0.0, np.inf], dtype=np.float32))
    assert model_has_nan(np.array([np.nan]))
    assert not model_has_nan(np.zeros(3, dtype=np.float32))
    assert not model_has_nan(None) and not model_has_nan({"a": 1}) and not model_has_nan(np.arange(3))
