"""`ray up cluster/onprem.yaml`, `ray job submit` and `ray down`, run for real against three emulated machines.

The machines (a head and two workers, each with its own address, process table, /tmp and home, reached by its
own sshd: see tests/emulated_machines.py) take the place of the servers a user lists in ``cluster/onprem.yaml``.
The config is the project's own, changed where this machine differs from the user's:
- the addresses (``head_ip``, ``worker_ips``) and the SSH key (a throwaway one) are the emulated machines';
- the install steps (uv downloaded with curl, a Python 3.11 venv made by uv, the pinned packages from PyPI) need
  the internet, which the emulated network has not: one step links ``~/venv`` to the venv that runs these tests
  instead (the pinned versions, with this checkout installed editable, as the config's `-e ~/rayfl` does).
  Every other command runs as written: the token made 600, the venv activated in ``~/.bashrc``, `ray down`'s
  stop of the workers, the MLflow server on the head's address, `ray start` on every node.

Then, as cluster/README.md tells a user: `ray up -y`, `ray dashboard` (the SSH forward), `ray job submit
--working-dir .` of a small `rayfl run`, `rayfl tune` (2 trials) and `rayfl compare` (2 rows) with default sizing,
MLflow read through the head's server, `ray down -y`.
Checked: both workers join (autoscaler v1 from the config), each node under its own address, the head with no
CPU; the token on every machine, mode 600; MLflow listening on the head's address only and the dashboard on
127.0.0.1 only; the run finishes, and its metrics and artifacts are on the head's MLflow server (the artifacts on
the head's disk, none on a worker); the client actors ran on both workers; `ray down` leaves no Ray process on
any machine. The sweep and the comparison each land on the head's server as one parent with two FINISHED
children, their artifacts on the head.

Not covered here: the download of uv and the installs from PyPI (no internet on the emulated network); a non-root
SSH user (the machines' ``ubuntu`` is uid 0); a second `ray up` (`--restart-only`), left out to keep the test
within minutes; one sshd host key for all three machines.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

# Timeouts are generous: on two cores shared with other work, `ray up` alone has taken three minutes (most of
# it the MLflow server's start, two workers importing MLflow).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REPO = Path(__file__).resolve().parents[2]
NAMES = ["head", "worker1", "worker2"]
CLIENTS, ROUNDS = 4, 2
EXPERIMENT = "ray-up"
VENV = Path(sys.prefix)
RAY_PROCESS = re.compile(r"raylet|gcs_server|dashboard|log_monitor|monitor\.py|default_worker|ray::|"
                         r"runtime_env/agent|ray_client_server|ray/_private/(workers|log_monitor)")


def derived_config(machines) -> dict:
    """cluster/onprem.yaml with the emulated machines' addresses and key, and the venv that runs the tests in
    place of the installs from the internet (see the module's docstring)."""
    cfg = yaml.safe_load((REPO / "cluster" / "onprem.yaml").read_text())
    head, *workers = machines.machines.values()
    cfg["provider"]["head_ip"] = head.ip
    cfg["provider"]["worker_ips"] = [w.ip for w in workers]
    cfg["auth"]["ssh_private_key"] = "~/.ssh/id_ed25519"
    installs = [c for c in cfg["setup_commands"] if "uv" in c.split() or "~/.local/bin/uv" in c]
    assert len(installs) == 3, f"expected the three install steps (uv, venv, packages): {installs}"
    setup = []
    for cmd in cfg["setup_commands"]:
        if cmd not in installs:
            setup.append(cmd)
        elif cmd == installs[0]:
            setup.append(f"ln -sfn {VENV} ~/venv")
    cfg["setup_commands"] = setup
    return cfg


def _tail(text: str, n: int = 6000) -> str:
    return text[-n:]


@pytest.fixture
def machines():
    from emulated_machines import Machines, missing_tools

    if missing := missing_tools():
        pytest.skip(f"cannot emulate the machines here (missing: {', '.join(missing)}; .ci/run installs "
                    f"openssh-server and rsync)")
    for tool in ("ray", "mlflow", "rayfl"):
        assert (VENV / "bin" / tool).exists(), f"{VENV}/bin/{tool} missing: the nodes run it from this venv"
    root = tempfile.mkdtemp(prefix="rfl-up-", dir="/tmp")
    lab = None
    try:
        lab = Machines(root, NAMES)
        yield lab
    finally:
        t = time.monotonic()
        left = lab.close() if lab is not None else []
        print(f"machines stopped in {time.monotonic() - t:.1f}s")
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes survived the teardown: {left}"


class Launcher:
    """Commands run where the user runs `ray up` (the emulated network's launcher), from the repository root."""

    def __init__(self, lab, token: str):
        self.lab = lab
        self.env = lab.launcher_env(str(REPO), RAY_AUTH_MODE="token",
                                    PATH=f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        self.token = token
        self.background: list[subprocess.Popen] = []

    def run(self, *cmd: str, timeout: float) -> subprocess.CompletedProcess:
        """``cmd`` to its end; one that runs past ``timeout`` is ended (its PID namespace with it) and answers
        returncode None with what it wrote."""
        try:
            return subprocess.run(self.lab.launcher_command(list(cmd)), env=self.env, capture_output=True,
                                  text=True, timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            return subprocess.CompletedProcess(e.cmd, None, text(e.stdout) + f"\n[ended after {timeout:.0f}s]",
                                               text(e.stderr))

    def start(self, *cmd: str, log: Path) -> subprocess.Popen:
        proc = subprocess.Popen(self.lab.launcher_command(list(cmd)), env=self.env, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.background.append(proc)
        return proc

    def get(self, url: str, data: dict | None = None, token: bool = False, raw: bool = False):
        """An HTTP answer from the emulated network (the dashboard through the forward, with the cluster's
        token; the head's MLflow server), parsed as JSON unless ``raw``; None if it does not answer."""
        cmd = ["curl", "-sf", "-m", "10"]
        if token:
            cmd += ["-H", f"Authorization: Bearer {self.token}"]
        if data is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(data)]
        r = self.lab.lan_run([*cmd, url], timeout=20)
        if r.returncode != 0:
            return None
        try:
            return r.stdout if raw else json.loads(r.stdout)
        except json.JSONDecodeError:
            return None

    def head_logs(self) -> str:
        """The ends of the head's autoscaler and MLflow server logs, for a failure's message."""
        head = self.lab.machines["head"]
        sessions = sorted((head.tmp / "ray").glob("session_2*"))  # session_latest links to the head's own /tmp
        logs = sessions[-1] / "logs" if sessions else head.tmp
        out = []
        for f in (logs / "monitor.out", logs / "monitor.log", head.home / "mlflow" / "server.log"):
            if f.exists():
                out.append(f"--- head {f.name}:\n{_tail(f.read_text(errors='replace'), 3000)}")
        return "\n".join(out)

    def stop(self) -> None:
        """End the background commands: SIGKILL to each unshare, whose --kill-child ends its command and so its
        PID namespace (unshare does not end on SIGTERM while it waits for its child)."""
        for proc in self.background:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_ray_up_job_submit_ray_down_on_emulated_machines(machines):
    t0 = time.monotonic()
    lab = machines
    head, worker1, worker2 = (lab.machines[n] for n in NAMES)
    token = secrets.token_hex(32)
    (lab.launcher_home / ".ray").mkdir()
    (lab.launcher_home / ".ray" / "auth_token").write_text(token)
    cfg_file = lab.launcher_home / "onprem.yaml"
    cfg_file.write_text(yaml.safe_dump(derived_config(lab), sort_keys=False))
    config = "/home/launcher/onprem.yaml"
    launcher = Launcher(lab, token)
    marks = {}
    try:
        # --- ray up ------------------------------------------------------------------------------------
        up = launcher.run("ray", "up", "-y", config, timeout=480)
        marks["ray up"] = time.monotonic() - t0
        assert up.returncode == 0, f"`ray up` failed:\n{_tail(up.stdout + up.stderr)}\n{launcher.head_logs()}"
        forward = launcher.start("ray", "dashboard", config, log=lab.root / "dashboard.log")
        # Both workers join (the autoscaler on the head starts them after `ray up` returns).
        deadline, nodes = time.monotonic() + 300, []
        while time.monotonic() < deadline:
            answer = launcher.get("http://127.0.0.1:8265/api/v0/nodes?limit=100&detail=1", token=True)
            if answer is not None:
                nodes = [n for n in answer["data"]["result"]["result"] if n["state"] == "ALIVE"]
                if len(nodes) == 3:
                    break
            assert forward.poll() is None, f"`ray dashboard` ended:\n{(lab.root / 'dashboard.log').read_text()}"
            time.sleep(2)
        marks["workers joined"] = time.monotonic() - t0
        by_ip = {n["node_ip"]: n for n in nodes}
        assert sorted(by_ip) == sorted(m.ip for m in (head, worker1, worker2)), \
            f"not every machine's node is up under its own address: {sorted(by_ip)}\n{launcher.head_logs()}"
        assert by_ip[head.ip]["is_head_node"]
        assert by_ip[head.ip]["resources_total"].get("CPU", 0) == 0
        for w in (worker1, worker2):
            assert by_ip[w.ip]["resources_total"].get("GPU") == 2, by_ip[w.ip]["resources_total"]
            assert by_ip[w.ip]["resources_total"].get("CPU", 0) >= 1

        # The token reached every machine, readable by its owner only; on the head, MLflow listens on the head's
        # address only and the dashboard on 127.0.0.1 only.
        for m in (head, worker1, worker2):
            f = m.home / ".ray" / "auth_token"
            assert f.read_text() == token and f.stat().st_mode & 0o777 == 0o600, (m.name, oct(f.stat().st_mode))
            assert f.parent.stat().st_mode & 0o777 == 0o700, m.name
        listening = {}
        for line in lab.machine_run(head, ["ss", "-ltnH"]).stdout.splitlines():
            address, _, port = line.split()[3].rpartition(":")
            listening.setdefault(int(port), set()).add(address)
        assert listening.get(5000) == {head.ip} and listening.get(8265) == {"127.0.0.1"}, listening

        # --- ray job submit ------------------------------------------------------------------------------
        job = launcher.run("ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".",
                           "--", "rayfl", "run", "--dataset", "synthetic", "--clients", str(CLIENTS),
                           "--rounds", str(ROUNDS), "--samples-per-client", "60", "--experiment", EXPERIMENT,
                           timeout=360)
        marks["job"] = time.monotonic() - t0
        out = job.stdout + job.stderr
        assert job.returncode == 0 and "succeeded" in out.lower(), \
            f"the job failed:\n{_tail(out)}\n{launcher.head_logs()}"
        tracking = f"http://{head.ip}:5000"
        m = re.search(r"MLflow run (\w+) in experiment '([^']+)' at (\S+)", out)
        assert m and m.group(2) == EXPERIMENT and m.group(3) == tracking, _tail(out)

        # --- the run on the head's MLflow server (its REST API, as the UI reads it) ------------------------
        run_id = m.group(1)
        experiment = launcher.get(f"{tracking}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT}")
        assert experiment, f"no experiment {EXPERIMENT!r} on the head's MLflow server"
        runs = launcher.get(f"{tracking}/api/2.0/mlflow/runs/search",
                            data={"experiment_ids": [experiment["experiment"]["experiment_id"]]})
        [run] = runs["runs"]
        assert run["info"]["run_id"] == run_id and run["info"]["status"] == "FINISHED", run["info"]
        for key in ("test_acc_mean", "test_loss_mean"):
            history = launcher.get(f"{tracking}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={key}")
            assert sorted(h["step"] for h in history["metrics"]) == list(range(1, ROUNDS + 1)), (key, history)
        assert run["info"]["artifact_uri"].startswith("mlflow-artifacts:"), run["info"]["artifact_uri"]
        listed = launcher.get(f"{tracking}/api/2.0/mlflow/artifacts/list?run_id={run_id}")
        assert "placement.json" in {f["path"] for f in listed.get("files", [])}, listed
        placement = json.loads(launcher.get(f"{tracking}/get-artifact?path=placement.json&run_uuid={run_id}",
                                            raw=True) or "null")
        marks["mlflow read"] = time.monotonic() - t0
        # The artifacts are on the head's disk, none in a worker's home or temp dir (the jobs' working dirs).
        on_disk = list((head.home / "mlflow" / "artifacts").rglob("placement.json"))
        assert len(on_disk) == 1 and run_id in str(on_disk[0]), on_disk
        for w in (worker1, worker2):
            stray = [p for d in (w.home, w.tmp) for name in ("mlruns", "mlflow.db") for p in d.rglob(name)]
            assert not stray, f"MLflow files on {w.name}: {stray}"
        # The client actors ran on both workers, every client in one of them.
        placement = placement["placement"] if isinstance(placement, dict) else placement
        assert sorted(c for a in placement for c in a["clients"]) == list(range(CLIENTS)), placement
        ip_of = {n["node_id"]: ip for ip, n in by_ip.items()}
        assert {ip_of.get(a["node_id"]) for a in placement} == {worker1.ip, worker2.ip}, \
            f"client actors not on both workers: {placement}"

        # --- a sweep of 2 trials and a comparison of 2 rows, the same way: default sizing, default storage --------
        (lab.root / "shared" / "space.yaml").write_text("grid:\n  lr: [0.05, 0.1]\n")
        small = ["--dataset", "synthetic", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
                 "--samples-per-client", "60"]
        for what, command, children in (
                ("tune", ["tune", "--algo", "fedavg", "--space", "/mnt/shared/space.yaml", *small], 2),
                ("compare", ["compare", "--algos", "fedavg,local", "--seeds", "0", *small], 2)):
            name = f"{EXPERIMENT}-{what}"
            job = launcher.run("ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".",
                               "--", "rayfl", *command, "--experiment", name, timeout=480)
            marks[what] = time.monotonic() - t0
            out = job.stdout + job.stderr
            assert job.returncode == 0 and "succeeded" in out.lower(), \
                f"the {what} job failed:\n{_tail(out)}\n{launcher.head_logs()}"
            experiment = launcher.get(f"{tracking}/api/2.0/mlflow/experiments/get-by-name?experiment_name={name}")
            assert experiment, f"no experiment {name!r} on the head's MLflow server:\n{_tail(out)}"
            found = launcher.get(f"{tracking}/api/2.0/mlflow/runs/search",
                                 data={"experiment_ids": [experiment["experiment"]["experiment_id"]]})["runs"]
            tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in found]
            parents = [r for r, t in zip(found, tags) if "mlflow.parentRunId" not in t]
            kids = [r for r, t in zip(found, tags) if "mlflow.parentRunId" in t]
            assert len(parents) == 1 and len(kids) == children, (what, [r["info"] for r in found])
            assert {r["info"]["status"] for r in found} == {"FINISHED"}, (what, [r["info"] for r in found])
            for r in found:
                assert r["info"]["artifact_uri"].startswith("mlflow-artifacts:"), r["info"]["artifact_uri"]
        marks["mlflow read"] = time.monotonic() - t0
        for w in (worker1, worker2):  # still no MLflow file on a worker
            stray = [p for d in (w.home, w.tmp) for name in ("mlruns", "mlflow.db") for p in d.rglob(name)]
            assert not stray, f"MLflow files on {w.name}: {stray}"
    finally:
        # --- ray down (also after a failure: the cluster goes down the way a user takes it down) -------------
        down = launcher.run("ray", "down", "-y", config, timeout=120)
        marks["ray down"] = time.monotonic() - t0
        launcher.stop()
    assert down.returncode == 0, f"`ray down` failed:\n{_tail(down.stdout + down.stderr)}"
    deadline, at_first = time.monotonic() + 30, None
    while True:
        left = {m.name: [c for _, c in lab.processes(m) if RAY_PROCESS.search(c)] for m in lab.machines.values()}
        at_first = left if at_first is None else at_first
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    marks["no Ray process left"] = time.monotonic() - t0
    print("seconds since the machines started: " + ", ".join(f"{k} {v:.0f}" for k, v in marks.items()))
    if any(at_first.values()):
        print("still ending when `ray down` returned: " + "; ".join(
            f"{name}: {', '.join(c.split()[0].rsplit('/', 1)[-1] for c in cmds)}" for name, cmds in at_first.items()))
    assert not any(left.values()), f"Ray processes left after `ray down`: {left}\n{_tail(down.stdout)}"
