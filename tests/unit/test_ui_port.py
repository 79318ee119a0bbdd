"""``--ui-port``: where the MLflow addresses that ``rayfl run``, ``tune`` and ``compare`` print point. A local
store's UI is ``mlflow ui`` on this machine (its port 5000 unless given), a tracking server's its own address
(another port when given); a bad port is one line, exit 2, before anything starts."""

from __future__ import annotations

import io

import pytest

from conftest import tiny
from rayfl.cli import main
from rayfl.progress import ConsoleProgress, mlflow_hint, ui_base, ui_url

LOCAL = "sqlite:////x/mlflow.db"


def test_a_local_stores_addresses_use_the_given_port_and_5000_without_one():
    assert ui_url(LOCAL, "7", "abc", 5055) == "http://127.0.0.1:5055/#/experiments/7/runs/abc?workflowType=machine_learning"
    assert ui_url(LOCAL, "7") == "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_base("/tmp/mlruns", 8080) == "http://127.0.0.1:8080"
    hint = mlflow_hint(LOCAL, "7", "abc", port=5055).splitlines()
    assert hint[0] == f"look at it: mlflow ui --backend-store-uri {LOCAL} --port 5055"  # the UI the addresses name
    assert hint[1] == "  then open http://127.0.0.1:5055/#/experiments/7/runs?workflowType=machine_learning"
    assert hint[2] == "  this run: http://127.0.0.1:5055/#/experiments/7/runs/abc?workflowType=machine_learning"
    assert mlflow_hint(LOCAL, "7").splitlines()[0] == f"look at it: mlflow ui --backend-store-uri {LOCAL}"


def test_a_tracking_servers_addresses_are_its_own_or_its_host_at_the_given_port():
    assert ui_base("http://head:5000/") == "http://head:5000"
    assert ui_base("http://head:5000/", 8080) == "http://head:8080"
    assert ui_base("https://user:secret@mlflow.example.org/", 8443) == "https://mlflow.example.org:8443"
    assert ui_base("http://[::1]:5000", 5055) == "http://[::1]:5055"
    assert "--backend-store-uri" not in mlflow_hint("http://head:5000", "7", port=8080)


def test_a_runs_console_prints_its_page_at_the_port_its_plan_names():
    from rayfl.experiment import prepare

    out = io.StringIO()
    console = ConsoleProgress(out, tty=False)
    console({"event": "plan", "cfg": tiny(), "prepared": prepare(tiny()), "run_dir": "/r", "tracking_uri": LOCAL,
             "ui_port": 5055})
    console({"event": "mlflow_run", "experiment_id": "7", "run_id": "abc"})
    assert out.getvalue().splitlines()[-1] == \
        "rayfl: watch it in MLflow: http://127.0.0.1:5055/#/experiments/7/runs/abc?workflowType=machine_learning"


@pytest.mark.parametrize("command", ["run", "tune", "compare"])
@pytest.mark.parametrize("value", ["abc", "0", "65536", "-1", "1.5", "", "5000x", "\uff15\uff10\uff10\uff10"])
def test_a_bad_port_is_one_line_exit_2_before_anything_starts(command, value, capsys, monkeypatch):
    import rayfl.session

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(rayfl.session, "start_ray", started)
    assert main([command, f"--ui-port={value}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"rayfl: error: --ui-port={value}: must be an integer port from 1 to 65535 (the one "
                   f"`mlflow ui --port` listens on)\n")


def test_every_command_that_runs_experiments_takes_the_flag(capsys):
    from rayfl.cli import build_parser

    parser = build_parser()
    for command in ("run", "tune", "compare"):
        args = parser.parse_args([command, "--ui-port", "5055"])
        assert args.ui_port == "5055"  # checked (and made an int) by main, before anything starts
