"""A user's own algorithm, from a file of its own, is a built-in's equal: the registry checks it against the
contract before anything starts, and run, tune, compare, checkpoints and MLflow take it, under Ray too (its
classes travel to the actors, which find it by name).

The plugin used throughout is FedAvg with a server step size eta (Reddi et al. 2021, Alg. 1 with SGD as the
server optimizer): the global model moves the fraction eta of the way to the clients' mean. Two facts about
it need no rayfl code to know: eta = 1 is FedAvg exactly ((1 - 1) * old + 1 * mean == mean in floating point),
and with eta = 0 the global model never moves, so every round evaluates the initial model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import tiny

PLUGIN = '''
"""FedAvg with a server step size eta (Reddi et al. 2021, Alg. 1, SGD as the server optimizer)."""

from dataclasses import dataclass

from rayfl.algorithms.base import Algorithm, Matrix
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import weighted_mean


@dataclass
class EtaParams:
    eta: float = 1.0  # server step size; 1 is FedAvg

    def check(self, n_clients: int) -> None:
        if not 0 <= self.eta <= 1:
            raise ValueError(f"eta={self.eta}: must be in [0, 1] (1 is FedAvg)")


class EtaServer(FedAvgServer):
    def run_round(self, stage, rnd, participants, call):
        old = self.get([self.global_ref])[0]
        ups = self.train_and_average(call, dict.fromkeys(participants, {"models": {"global": self.global_ref}}))
        mean = self.get([self.global_ref])[0]
        self.global_ref = self.put((1 - self.params.eta) * old + self.params.eta * mean)
        return {"train_loss": weighted_mean(ups, "train_loss")}


class EtaClient(FedAvgClient):
    pass


ALGORITHM = Algorithm("fedeta", EtaParams, EtaServer, EtaClient, "FedAvg with a server step size eta",
                      implies={}, plots={"P": Matrix("eta's matrix")})
'''

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAYFL = os.path.join(os.path.dirname(sys.executable), "rayfl")


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test starts with nothing registered from outside the package, as a new process does."""
    from rayfl import algorithms, plugins

    monkeypatch.setattr(algorithms, "_registered", {})
    monkeypatch.setattr(algorithms, "_sources", {})
    monkeypatch.setattr(algorithms, "_adopted", set())
    monkeypatch.setattr(plugins, "_loaded", {})


@pytest.fixture
def no_ray(monkeypatch):
    """Starting or joining Ray fails the test: a mistake must be refused before (run, compare and tune each
    begin their Ray part with start_ray; another test's session may already be connected)."""
    import importlib

    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", refuse)
    # all imported first: a module imported while session.start_ray is patched would keep the patch
    modules = [importlib.import_module(m) for m in ("rayfl.session", "rayfl.api", "rayfl.comparison.run",
                                                    "rayfl.sweep.command")]
    for module in modules:
        if hasattr(module, "start_ray"):  # the session's, and any module that imported it by name
            monkeypatch.setattr(module, "start_ray", refuse)


def write(folder, name: str, text: str) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def settings(tmp_path, **extra) -> dict:
    """tiny()'s values as keyword arguments, with a private MLflow store and run directory."""
    values = {k: getattr(tiny(), k) for k in ("dataset", "partition", "clients", "rounds", "samples_per_client",
                                              "lr", "batch_size")}
    return {**values, "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "out_dir": str(tmp_path / "runs"),
            **extra}


def env_for_subprocess(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYFL_PLUGINS")}
    return {**env, "RAY_AUTH_MODE": "disabled", **extra}


# --------------------------------------------------------------------------------------------------
# The contract, checked at the door
# --------------------------------------------------------------------------------------------------
BROKEN = {
    "no Params": ('Algorithm("bad", None, EtaServer, EtaClient)', "Params=None is not a dataclass"),
    "no Server": ('Algorithm("bad", EtaParams, None, EtaClient)', "Server=None is not a subclass"),
    "no ClientLogic": ('Algorithm("bad", EtaParams, EtaServer, None)', "ClientLogic=None is not a subclass"),
    "Params not a dataclass": ('Algorithm("bad", Plain, EtaServer, EtaClient)', "Params=class Plain is not a dataclass"),
    "a knob without a default": ('Algorithm("bad", NoDefault, EtaServer, EtaClient)',
                                 "Params field 'mu' has no default"),
    "no step": ('Algorithm("bad", EtaParams, EtaServer, NoSteps)', "defines no step_<name>"),
    "no run_round": ('Algorithm("bad", EtaParams, NoRound, EtaClient)', "does not define run_round"),
    "a built-in's name": ('Algorithm("fedavg", EtaParams, EtaServer, EtaClient)',
                          "already the name of a built-in algorithm"),
    "a space in the name": ('Algorithm("my algo", EtaParams, EtaServer, EtaClient)', "letters, digits"),
    "a colon in the name": ('Algorithm("my:algo", EtaParams, EtaServer, EtaClient)', "letters, digits"),
    "an empty name": ('Algorithm("", EtaParams, EtaServer, EtaClient)', "letters, digits"),
    "implies a knob it lacks": ('Algorithm("bad", EtaParams, EtaServer, EtaClient, implies={"eta": {"nope": 1}})',
                                "implies names 'nope'"),
    "not an algorithm": ('"fedeta"', "not an algorithm"),
}
EXTRAS = '''

from rayfl.algorithms.base import ClientLogic, Server


class Plain:
    eta = 1.0

    def check(self, n_clients):
        pass


@dataclass
class NoDefault:
    mu: float

    def check(self, n_clients):
        pass


class NoSteps(ClientLogic):
    pass


class NoRound(Server):
    pass
'''


def broken_plugin(folder, case: str) -> str:
    body = PLUGIN.replace("ALGORITHM = Algorithm(", "GOOD = Algorithm(")
    return write(folder, f"broken_{abs(hash(case))}.py", body + EXTRAS + f"\nALGORITHM = {BROKEN[case][0]}\n")


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_algorithm_is_one_line_exit_2_before_ray(tmp_path, capsys, no_ray, case):
    from rayfl.cli import main

    path = broken_plugin(tmp_path, case)
    t0 = time.monotonic()
    code = main(["run", "--plugin", path, "--algo", "bad", *flags(tiny_cli(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"rayfl: error: plugin={path!r}: "), err
    assert BROKEN[case][1] in err
    assert time.monotonic() - t0 < 30  # refused at once (the budget is for a loaded 2-core machine)


@pytest.mark.parametrize("case", ["no run_round", "a built-in's name", "Params not a dataclass"])
def test_register_algorithm_from_python_raises_user_error(tmp_path, case):
    import rayfl
    from rayfl.plugins import _import

    _, module = _import(broken_plugin(tmp_path, case), "test")
    from rayfl.algorithms import algorithm_names

    with pytest.raises(rayfl.UserError, match=BROKEN[case][1].replace("(", r"\(")):
        rayfl.register_algorithm(module.ALGORITHM)
    assert "bad" not in algorithm_names()


def test_the_same_algorithm_twice_is_fine_another_of_the_same_name_is_not(tmp_path):
    import rayfl
    from rayfl.algorithms import algorithm_names, get_algorithm
    from rayfl.plugins import _import

    _, module = _import(write(tmp_path, "eta.py", PLUGIN), "test")
    assert rayfl.register_algorithm(module.ALGORITHM) == ["fedeta"]
    assert rayfl.register_algorithm(module.ALGORITHM) == ["fedeta"]  # the same object again
    assert rayfl.register_algorithm(module) == ["fedeta"]  # a module defining ALGORITHM: the same object
    assert get_algorithm("fedeta") is module.ALGORITHM and "fedeta" in algorithm_names()
    import dataclasses

    other = dataclasses.replace(module.ALGORITHM, summary="another")
    with pytest.raises(rayfl.UserError, match="algo='fedeta': already registered"):
        rayfl.register_algorithm(other)
    assert get_algorithm("fedeta") is module.ALGORITHM


def test_every_built_in_algorithm_keeps_the_contract():
    from rayfl.algorithms import builtin_algorithms, check_algorithm

    for algo in builtin_algorithms().values():
        check_algorithm(algo)


@pytest.mark.parametrize("source, says", [
    ("{tmp}/missing.py", "no such file"),
    ("{tmp}", "not a .py file"),
    ("no_such_module_anywhere", "no such file or module"),
    ("{tmp}/raises.py", "importing it failed: RuntimeError: plugin broke"),
    ("{tmp}/syntax.py", "importing it failed: SyntaxError"),
    ("{tmp}/empty.py", "defines none of ALGORITHM, ALGORITHMS, DATASET"),
])
def test_a_plugin_that_cannot_be_loaded_is_one_line(tmp_path, capsys, no_ray, source, says):
    from rayfl.cli import main

    write(tmp_path, "raises.py", "import os\nraise RuntimeError('plugin broke\\nsecond line')\n")
    write(tmp_path, "syntax.py", "def f(:\n")
    write(tmp_path, "empty.py", "X = 1\n")
    source = source.format(tmp=tmp_path)
    for command in (["algos"], ["run", "--algo", "fedavg", *flags(tiny_cli(tmp_path))],
                    ["compare", "--algos", "fedavg", "--seeds", "0", *flags(tiny_cli(tmp_path))],
                    ["tune", "--algo", "fedavg", *flags(tiny_cli(tmp_path))]):
        code = main([command[0], "--plugin", source, *command[1:]])
        err = capsys.readouterr().err
        assert code == 2, (command, err)
        assert err.count("\n") == 1 and err.startswith(f"rayfl: error: plugin={source!r}: ") and says in err, err
        assert "Traceback" not in err


def test_the_environment_variable_names_plugins_too(tmp_path, monkeypatch, capsys):
    from rayfl.cli import main

    path = write(tmp_path, "eta.py", PLUGIN)
    monkeypatch.setenv("RAYFL_PLUGINS", os.pathsep.join([path, ""]))
    assert main(["algos"]) == 0
    out = capsys.readouterr().out
    assert "fedeta" in out and f"[from {path}]" in out and "knobs: eta=1.0" in out
    monkeypatch.setenv("RAYFL_PLUGINS", str(tmp_path / "gone.py"))
    assert main(["algos"]) == 2
    assert "RAYFL_PLUGINS entry" in capsys.readouterr().err


def test_knobs_of_a_plugin_are_checked_as_a_built_ins_are(tmp_path, capsys, no_ray):
    from rayfl.cli import main

    path = write(tmp_path, "eta.py", PLUGIN)
    for knob, says in (("eta=2", "eta=2.0: must be in [0, 1]"), ("nope=1", "nope=1: unknown parameter for "
                                                                           "algorithm 'fedeta'; allowed: eta"),
                       ("eta=nan", "eta=")):
        code = main(["run", "--plugin", path, "--algo", "fedeta", "-p", knob, *flags(tiny_cli(tmp_path))])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err


def test_a_plugins_knob_ties_reach_the_sweep(tmp_path):
    """A sweep over a knob the algorithm ties to another sets that one too (Algorithm.implies), unless the user
    did: what PersFL declares for its lam / lam_grid, read from the declaration, not from a name."""
    import dataclasses

    import rayfl
    from rayfl.plugins import _import
    from rayfl.sweep.space import Space, plan_sweep

    _, module = _import(write(tmp_path, "eta.py", PLUGIN.replace(
        "    eta: float = 1.0  # server step size; 1 is FedAvg",
        "    eta: float = 1.0  # server step size; 1 is FedAvg\n    etas: tuple = (0.5, 1.0)")), "test")
    rayfl.register_algorithm(dataclasses.replace(module.ALGORITHM, implies={"eta": {"etas": ()}}))
    plan = plan_sweep(Space("s.yaml", grid={"eta": [0.5, 1.0]}), {}, {"algo": "fedeta"}, {})
    assert plan.base["params"] == {"etas": ()}
    plan = plan_sweep(Space("s.yaml", grid={"eta": [0.5, 1.0]}), {}, {"algo": "fedeta"}, {"etas": (0.1,)})
    assert plan.base["params"] == {"etas": (0.1,)}
    plan = plan_sweep(Space("s.yaml", grid={"lr": [0.1]}), {}, {"algo": "fedeta"}, {})
    assert plan.base["params"] == {}


def test_a_plugins_matrix_caption_and_second_comparison_row_are_its_own(tmp_path):
    import dataclasses

    import rayfl
    from rayfl.comparison.run import final_rows, work_of
    from rayfl.plots import caption
    from rayfl.plugins import _import

    _, module = _import(write(tmp_path, "eta.py", PLUGIN), "test")
    rayfl.register_algorithm(dataclasses.replace(module.ALGORITHM, compare_before={"polish": "unpolished"},
                                                 work="FedAvg's, then a polish"))
    assert caption("fedeta", "P", [[1.0, -1.0]]) == ("eta's matrix", ("client j", "client i"), True, None)
    assert caption("fedeta", "Q", [[1.0]])[0] == "fedeta: Q (row: client, column: client)"
    history = [{"stage": "train", "test_acc_mean": 0.25}, {"stage": "train", "test_acc_mean": 0.5},
               {"stage": "polish", "test_acc_mean": 0.75}]
    rows = final_rows("fedeta:eta=0.5", 0, {"final": history[-1], "history": history})
    assert [(r["algo"], r["test_acc_mean"]) for r in rows] == [("fedeta:eta=0.5", 0.75),
                                                              ("fedeta-unpolished:eta=0.5", 0.5)]
    assert work_of("fedeta-unpolished:eta=0.5") == work_of("fedeta") == "FedAvg's, then a polish"


# --------------------------------------------------------------------------------------------------
# Everywhere a built-in goes, on Ray
# --------------------------------------------------------------------------------------------------
def tiny_cli(tmp_path) -> dict:
    return settings(tmp_path)


def flags(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_run_checkpoint_resume_and_mlflow_on_ray(tmp_path, ray_session):
    """rayfl.run with plugins=[file] on Ray (its actors find the plugin's algorithm by name), then a resume in a
    registry that has forgotten it: the run directory's record names it, and it must be given again."""
    import mlflow

    import rayfl
    from rayfl import algorithms, plugins

    path = write(tmp_path, "eta.py", PLUGIN)
    result = rayfl.run(plugins=[path], algo="fedeta", params={"eta": 0.0}, checkpoint_every=1, run_name="eta0",
                       progress=False, **settings(tmp_path))
    losses = list(result.history["test_loss_mean"])
    assert len(losses) == 2 and losses[0] == losses[1]  # eta = 0: the initial model, every round
    run = mlflow.MlflowClient(result.tracking_uri).get_run(result.run_id)
    assert run.data.params["algo"] == "fedeta" and run.data.params["param.eta"] == "0.0"
    assert run.data.tags["rayfl.algo"] == "fedeta" and run.data.tags["rayfl.plugins"] == path
    with open(os.path.join(result.run_dir, "plugins.yaml")) as f:
        assert path in f.read()

    algorithms._registered.clear()  # as a new process: nothing registered
    plugins._loaded.clear()
    with pytest.raises(rayfl.UserError, match=f"the run used plugin '{path}' \\(algorithm fedeta\\), which is not "
                                              "loaded; a run directory's plugins are never imported from it"):
        rayfl.run(resume=result.run_dir, progress=False)
    again = rayfl.run(resume=result.run_dir, plugins=[path], progress=False)  # given again: it goes on
    assert again.run_id == result.run_id and again.final["test_loss_mean"] == losses[-1]
    moved = os.path.join(os.path.dirname(path), "moved.py")
    os.rename(path, moved)
    algorithms._registered.clear()
    plugins._loaded.clear()
    rayfl.run(resume=result.run_dir, plugins=[moved], progress=False)  # its algorithm, from where it is now


def test_compare_a_plugin_with_fedavg_on_ray(tmp_path, ray_session):
    """eta = 1 is FedAvg to the last bit: the same federation, the same training, the same numbers."""
    import rayfl

    path = write(tmp_path, "eta.py", PLUGIN)
    result = rayfl.compare(["fedavg", "fedeta"], seeds=[0], plugins=[path], **settings(tmp_path, lr=0.3))
    rows = result.runs.set_index("algo")
    for metric in ("test_acc_mean", "test_loss_mean", "val_loss_mean"):
        assert rows.loc["fedeta", metric] == rows.loc["fedavg", metric]
    assert list(result.table["algo"]) == ["fedavg", "fedeta"]


def test_tune_a_plugin_on_ray(tmp_path, ray_session):
    import rayfl

    path = write(tmp_path, "eta.py", PLUGIN)
    result = rayfl.tune(plugins=[path], algo="fedeta", space={"grid": {"eta": [0.0, 1.0]}}, progress=False,
                        storage_path=str(tmp_path / "tune"), name="eta", **settings(tmp_path))
    assert sorted(result.table["eta"]) == [0.0, 1.0] and set(result.table["status"]) == {"DONE"}


def test_the_command_with_a_plugin_file_and_a_plugin_package(tmp_path):
    """In fresh processes, as a user types it: ``rayfl run --plugin FILE`` on its own private Ray, and an
    installed package's entry point (a dist-info folder on PYTHONPATH) that ``rayfl algos`` lists."""
    import mlflow

    path = write(tmp_path, "eta.py", PLUGIN)
    base = flags(settings(tmp_path, rounds=1, clients=2, run_name="cli"))
    done = subprocess.run([RAYFL, "run", "--plugin", path, "--algo", "fedeta", "-p", "eta=0.5", "--quiet", *base],
                          capture_output=True, text=True, env=env_for_subprocess(), cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final round 1 (train), across clients:" in done.stdout
    runs = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(["1"])
    assert [(r.data.params["algo"], r.data.params["param.eta"], r.info.status) for r in runs] == [
        ("fedeta", "0.5", "FINISHED")]

    package = tmp_path / "site"
    (package / "etapkg-0.1.dist-info").mkdir(parents=True)
    write(package, "etapkg_algos.py", PLUGIN.replace('"fedeta"', '"fedeta-pkg"'))
    write(package / "etapkg-0.1.dist-info", "METADATA", "Metadata-Version: 2.1\nName: etapkg\nVersion: 0.1\n")
    write(package / "etapkg-0.1.dist-info", "entry_points.txt", "[rayfl.algorithms]\neta = etapkg_algos\n")
    env = env_for_subprocess(PYTHONPATH=str(package))
    done = subprocess.run([RAYFL, "algos"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "fedeta-pkg" in done.stdout and "[from entry point etapkg_algos]" in done.stdout
    write(package, "etapkg_algos.py", "raise ImportError('half installed')\n")
    done = subprocess.run([RAYFL, "algos"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("rayfl: error: entry point eta = etapkg_algos (group rayfl.algorithms): importing "
                                  "it failed: ImportError: half installed"), done.stderr


def test_an_entry_point_algorithm_runs_on_ray(tmp_path, monkeypatch, ray_session):
    """An entry point read in this process (a dist-info folder put on sys.path): its algorithm runs on Ray's
    actors, which were started before that folder was on any path (it travels with the run)."""
    import rayfl
    from rayfl import algorithms

    package = tmp_path / "site"
    (package / "etapkg2-0.1.dist-info").mkdir(parents=True)
    write(package, "etapkg2_algos.py", PLUGIN.replace('"fedeta"', '"fedeta-ep"'))
    write(package / "etapkg2-0.1.dist-info", "METADATA", "Metadata-Version: 2.1\nName: etapkg2\nVersion: 0.1\n")
    write(package / "etapkg2-0.1.dist-info", "entry_points.txt", "[rayfl.algorithms]\neta = etapkg2_algos\n")
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(algorithms, "_entry_points", {"state": "unread"})
    assert "fedeta-ep" in algorithms.algorithm_names()
    result = rayfl.run(algo="fedeta-ep", progress=False, **settings(tmp_path))
    assert result.final["round"] == 2 and 0 <= result.final["test_acc_mean"] <= 1


def test_a_plugin_that_registers_its_algorithm_itself_is_recorded_as_its_source(tmp_path, capsys):
    from rayfl.algorithms import algorithm_source
    from rayfl.cli import main

    path = write(tmp_path, "self_registering.py", PLUGIN.replace("ALGORITHM = Algorithm(", "import rayfl\n"
                                                                  "rayfl.register_algorithm(Algorithm(") + ")\n")
    assert main(["algos", "--plugin", path]) == 0
    assert "fedeta" in capsys.readouterr().out and algorithm_source("fedeta") == path


def test_a_plugins_model_goes_to_the_model_registry(tmp_path, monkeypatch, capsys):
    """A plugin's MODEL is registered through rayfl.models.register_model (whose checks apply, as one line)."""
    from rayfl import models
    from rayfl.cli import main

    monkeypatch.setattr(models, "MODELS", dict(models.MODELS))  # registered models are forgotten after the test
    path = write(tmp_path, "net.py", '''
        import torch
        from rayfl.models import ModelSource

        MODEL = ModelSource("tiny-linear", lambda shape, n: torch.nn.Sequential(torch.nn.Flatten(),
                                                                                 torch.nn.LazyLinear(n)))
        ''')
    assert main(["algos", "--plugin", path]) == 0
    assert "tiny-linear" in capsys.readouterr().out and "tiny-linear" in models.registered()
    bad = write(tmp_path, "bad_net.py", "from rayfl.models import ModelSource\nMODEL = ModelSource('x-net', 3)\n")
    assert main(["algos", "--plugin", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rayfl: error: plugin={bad!r}: model='x-net': factory 3 is not "
                                                   f"callable"), err
