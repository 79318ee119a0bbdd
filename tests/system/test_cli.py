"""The command line: user mistakes end in one line and exit 2 before any actor starts; help reads;
an end-to-end `rayfl run` prints progress and a summary and leaves an MLflow run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rayfl.cli import main

RAYFL = [sys.executable, "-m", "rayfl.cli"]


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--algo", "fedsgd"], "algo='fedsgd': unknown; allowed: "),
    (["run", "--dataset", "imagenet"], "dataset='imagenet': unknown"),
    (["run", "--partition", "zipf"], "partition='zipf': unknown"),
    (["run", "--model", "resnet"], "model='resnet': unknown"),
    (["run", "--clients", "0"], "clients=0: must be an integer >= 1"),
    (["run", "--rounds", "0"], "rounds=0: must be an integer >= 1"),
    (["run", "--rounds", "two"], "rounds='two': must be an integer"),
    (["run", "--participation", "1.5"], "participation=1.5: must be in (0, 1]"),
    (["run", "--participation", "0"], "participation=0.0: must be in (0, 1]"),
    (["run", "--val-frac", "-0.1"], "val_frac=-0.1: must be in [0, 1)"),
    (["run", "--classes-per-client", "11"], "classes_per_client=11"),
    (["run", "--data-root", "/no/such/dir"], "data_root='/no/such/dir': no such directory"),
    (["run", "--dataset", "cifar10", "--data-root", "."], "dataset 'cifar10' needs its files"),
    (["run", "-p", "nope=1"], "nope=1: unknown parameter for algorithm 'fedavg'; allowed: "),
    (["run", "-p", "novalue"], "--param 'novalue': expected KEY=VALUE"),
    (["run", "--config", "/no/such.yaml"], "config file '/no/such.yaml': no such file"),
    (["run", "--resume", "/tmp"], "--resume '/tmp': no config.yaml there"),
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert err.count("\n") == 1 and err.startswith("rayfl: error: ")


def test_no_traceback_from_the_real_command(tmp_path):
    out = subprocess.run([*RAYFL, "run", "--clients", "0"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == "rayfl: error: clients=0: must be an integer >= 1\n"
    assert not os.path.exists(tmp_path / "mlflow.db")  # nothing was started or written


def test_help_reads(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--algo", "--dataset", "--partition", "--clients", "--rounds", "--participation",
                 "--local-epochs", "--lr", "--batch-size", "--seed", "--val-frac", "--clients-per-actor",
                 "--gpus-per-actor", "--tracking-uri", "--config", "--param"):
        assert flag in text
    assert main([]) == 0 and "rayfl run" in capsys.readouterr().out


def test_compare_offers_algos_and_refuses_algo_naming_it(capsys):
    """compare takes the run's flags but --algo: its help lists --algos alone, and --algo is one line naming
    --algos (flags are never abbreviated, so --algo is no prefix of --algos either)."""
    import re

    with pytest.raises(SystemExit) as e:
        main(["compare", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--algos" in text and not re.search(r"--algo(?!s)", text)
    assert main(["compare", "--algo", "fedavg"]) == 2
    assert capsys.readouterr().err.strip() == ("rayfl: error: --algo 'fedavg': compare takes --algos A,B,... "
                                               "(did you mean --algos?)")


def test_algos_lists_knobs(capsys):
    assert main(["algos"]) == 0
    out = capsys.readouterr().out
    assert "fedavg-ft" in out and "ft_epochs=1" in out and "mlp-small" in out


def test_run_end_to_end(tmp_path):
    """The real command on a private Ray: progress lines, the summary table, the MLflow run; every port the
    private instance opens is on the loopback address; the run directory records what --resume needs."""
    import psutil
    import yaml

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # the user's setting; the private instance uses a token
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([*RAYFL, "run", "--dataset", "synthetic", "--partition", "iid", "--clients", "2",
                             "--rounds", "2", "--samples-per-client", "60", "--tracking-uri", uri,
                             "--out-dir", str(tmp_path / "runs"), "--run-name", "e2e", "--checkpoint-every", "1",
                             "--ui-port", "5055"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    listening = set()
    while proc.poll() is None:
        try:
            pids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | {proc.pid}
        except psutil.NoSuchProcess:
            break
        listening |= {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN and c.pid in pids}
        time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert listening, "the private Ray instance was never seen listening"
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip, _ in listening), listening
    assert "round   1/2 [train]" in stdout and "round   2/2 [train]" in stdout
    assert "test_acc" in stdout and "bottom10%" in stdout and "mlflow ui" in stdout
    saved = yaml.safe_load((tmp_path / "runs" / "e2e" / "config.yaml").read_text())
    assert saved["tracking_uri"] == uri and saved["out_dir"] == str(tmp_path / "runs")
    import mlflow

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["rayfl"])
    assert list(runs["tags.mlflow.runName"]) == ["e2e"] and list(runs["status"]) == ["FINISHED"]
    # where to watch it, before its first round
    lines = stdout.splitlines()
    watch = next(i for i, line in enumerate(lines) if line.startswith("rayfl: watch it in MLflow: "))
    assert watch < next(i for i, line in enumerate(lines) if line.startswith("round   1/2"))
    assert lines[watch].endswith(f"/#/experiments/{runs['experiment_id'][0]}/runs/{runs['run_id'][0]}"
                                 "?workflowType=machine_learning")
    # --ui-port: every address printed points at the UI's port given, and the hint starts the UI there
    page = f"http://127.0.0.1:5055/#/experiments/{runs['experiment_id'][0]}/runs/{runs['run_id'][0]}"
    assert lines[watch] == f"rayfl: watch it in MLflow: {page}?workflowType=machine_learning"
    assert f"  this run: {page}?workflowType=machine_learning" in lines
    assert f"look at it: mlflow ui --backend-store-uri {uri} --port 5055" in lines

    # --resume from another working directory, with another MLFLOW_TRACKING_URI in the environment: the run
    # goes on in the store it was started with, not in a new ./mlflow.db.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*RAYFL, "run", "--resume", str(tmp_path / "runs" / "e2e"), "--quiet"],
                         capture_output=True, text=True, cwd=elsewhere, timeout=300,
                         env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{elsewhere}/other.db"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(elsewhere.iterdir()) == []
    assert f"at {uri}" in out.stdout
    assert f"  this run: {page.replace(':5055/', ':5000/')}?workflowType=machine_learning" in out.stdout.splitlines()
    runs = mlflow.search_runs(experiment_names=["rayfl"])
    assert list(runs["tags.mlflow.runName"]) == ["e2e"] and list(runs["status"]) == ["FINISHED"]

