"""The cluster-launcher configs in cluster/ are valid for the installed Ray, and keep their ports private.

What `ray up` does before it launches anything: the JSON schema shipped inside the ray package, then
Ray's own ``prepare_config`` + ``validate_config`` (private API, as `ray up` calls them). On top of
that, the points a schema cannot see: the head takes no Ray work, token auth reaches every node,
every `ray start` / `mlflow server` flag exists in the installed versions, every command is valid
bash, and neither the security group nor a bind address exposes MLflow or the dashboard.
Fast: no cluster, no network.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

# Importing ray's CLI pulls in ray.serve, whose pydantic models warn about deprecated Field usage.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CLUSTER_DIR = pathlib.Path(__file__).resolve().parents[2] / "cluster"
CONFIGS = ["cluster.yaml", "onprem.yaml"]
SCHEMA = json.loads((pathlib.Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
PRIVATE_PORTS = {5000, 8265, 6379, 10001, 2049, 8076, 52365}
COMMAND_KEYS = ["initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"]


def load(name: str) -> dict:
    with open(CLUSTER_DIR / name) as f:
        return yaml.safe_load(f)


def all_commands(cfg: dict) -> list[str]:
    cmds = [c for key in COMMAND_KEYS for c in cfg.get(key) or []]
    for node_type in (cfg.get("available_node_types") or {}).values():
        cmds += node_type.get("worker_setup_commands") or []
    return cmds


def segments(command: str, program: str) -> list[list[str]]:
    """The argument lists of every invocation of ``program`` ("ray start", "mlflow server") in a line."""
    out = []
    for part in re.split(r";|&&|\|\||\bthen\b|\belse\b", command):
        part = re.sub(r"^(\w+=\S*\s+)+", "", part.strip())  # the environment given to this command alone
        if part.startswith("nohup "):
            part = part[len("nohup "):]
        if part.startswith(program + " "):
            # Drop redirections and a trailing '&' that belong to the shell, not the program.
            words = shlex.split(re.split(r"\s[0-9]?>|\s<|\s&(?:\s|$)", " " + part)[0])
            out.append(words[len(program.split()):])
    return out


def options(args: list[str]) -> dict[str, str | None]:
    opts, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            if "=" in a:
                k, v = a.split("=", 1)
                opts[k] = v
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                opts[a] = args[i + 1]
                i += 1
            else:
                opts[a] = None
        i += 1
    return opts


def head_ip_of(cmd: str, cfg: dict) -> str:
    """What ``$HEAD_IP`` is in a head command run by `ray up`, which reaches the head over SSH at head_ip
    (``$SSH_CONNECTION``: client address, client port, server address, server port)."""
    assignment = re.search(r"HEAD_IP=\$\(([^()]*)\)", cmd).group(1)
    env = {"PATH": "/usr/bin:/bin", "SSH_CONNECTION": f"192.0.2.7 50000 {cfg['provider']['head_ip']} 22"}
    return subprocess.run(["bash", "-c", assignment], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def ray_starts(cfg: dict, key: str) -> list[tuple[str, dict]]:
    return [(c, options(seg)) for c in cfg.get(key) or [] for seg in segments(c, "ray start")]


def mlflow_servers(cfg: dict) -> list[tuple[str, dict]]:
    return [(c, options(seg)) for c in all_commands(cfg) for seg in segments(c, "mlflow server")]


# --- validity ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_schema_shipped_with_ray(name):
    errors = [f"{'/'.join(map(str, e.path)) or '<top>'}: {e.message}"
              for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(load(name))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_up_prepare_and_validate(name):
    prepared = prepare_config(copy.deepcopy(load(name)))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_schema_check_is_not_vacuous():
    bad = copy.deepcopy(load("cluster.yaml"))
    bad["setup_command"] = bad.pop("setup_commands")
    bad["available_node_types"]["gpu.1x"]["resources"]["GPU"] = 0.5
    messages = " ".join(e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(bad))
    assert "setup_command" in messages and "0.5 is not of type 'integer'" in messages


@pytest.mark.parametrize("name", CONFIGS)
def test_every_command_is_valid_bash(name):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for cmd in all_commands(load(name)):
        r = subprocess.run([bash, "-n", "-c", cmd], capture_output=True, text=True)
        assert r.returncode == 0, f"{cmd!r}: {r.stderr}"


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_start_and_mlflow_flags_exist(name):
    from ray.scripts.scripts import start

    ray_flags = {o for p in start.params for o in p.opts}
    cfg = load(name)
    starts = ray_starts(cfg, "head_start_ray_commands") + ray_starts(cfg, "worker_start_ray_commands")
    assert len(starts) == 2
    for cmd, opts in starts:
        unknown = set(opts) - ray_flags
        assert not unknown, f"`ray start` has no {sorted(unknown)} (in {cmd!r})"
    mlflow_cli = pytest.importorskip("mlflow.cli")
    mlflow_flags = {o for p in mlflow_cli.server.params for o in p.opts}
    servers = mlflow_servers(cfg)
    assert len(servers) == 1
    for cmd, opts in servers:
        unknown = set(opts) - mlflow_flags
        assert not unknown, f"`mlflow server` has no {sorted(unknown)} (in {cmd!r})"


@pytest.mark.parametrize("name", CONFIGS)
def test_installs_rayfl_from_the_synced_tree_with_the_tested_ray(name):
    cfg = load(name)
    assert cfg["file_mounts"].get("~/rayfl") == "."
    setup = " ".join(cfg.get("setup_commands", []))
    assert "-e ~/rayfl" in setup
    pinned = re.findall(r"ray\[[^\]]*\]==([0-9.]+)", setup)
    assert pinned == [ray.__version__], "the cluster must run the Ray version the tests ran with"
    excluded = set(cfg.get("rsync_exclude", []))
    assert {".venv", ".git", "mlflow.db"} <= excluded


# --- the head takes no Ray work; GPUs on the workers -------------------------------------------------

def test_aws_node_types():
    cfg = load("cluster.yaml")
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and head["resources"].get("GPU", 0) == 0
    [(_, head_opts)] = ray_starts(cfg, "head_start_ray_commands")
    assert head_opts.get("--num-cpus") == "0" and head_opts.get("--num-gpus") == "0"
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert workers and all(v["resources"].get("GPU", 0) >= 1 for v in workers.values())
    assert all(0 <= v.get("min_workers", 0) <= v["max_workers"] for v in workers.values())
    assert any(v.get("min_workers", 0) >= 1 for v in workers.values())
    # One AMI for every node type (the &ami anchor), so head and workers run the same software.
    assert len({v["node_config"]["ImageId"] for v in types.values()}) == 1


def test_onprem_uses_the_local_provider_with_gpu_workers():
    cfg = load("onprem.yaml")
    assert cfg["provider"]["type"] == "local"
    assert cfg["provider"]["head_ip"] and cfg["provider"]["worker_ips"]
    assert "available_node_types" not in cfg  # prepare_local aborts otherwise
    [(_, worker_opts)] = ray_starts(cfg, "worker_start_ray_commands")
    assert float(worker_opts["--num-gpus"]) >= 1
    [(_, head_opts)] = ray_starts(cfg, "head_start_ray_commands")
    assert head_opts.get("--num-cpus") == "0" and head_opts.get("--num-gpus") == "0"
    prepared = prepare_config(copy.deepcopy(cfg))
    node_type = prepared["available_node_types"]["local.cluster.node"]
    assert node_type["min_workers"] == node_type["max_workers"] == len(cfg["provider"]["worker_ips"])


# --- security -----------------------------------------------------------------------------------------

def _rule_ports(rule: dict) -> set[int] | None:
    """The ports a rule opens; None means all of them."""
    if str(rule.get("IpProtocol")) == "-1" or rule.get("FromPort", -1) == -1:
        return None
    return set(range(int(rule["FromPort"]), int(rule["ToPort"]) + 1))


def exposures(cfg: dict) -> list[str]:
    """Inbound rules (beyond Ray's intra-group + SSH defaults) that open a private port or the internet."""
    found = []
    for rule in cfg["provider"].get("security_group", {}).get("IpPermissions", []):
        cidrs = [r.get("CidrIp") for r in rule.get("IpRanges", [])] + \
                [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        ports = _rule_ports(rule)
        if "0.0.0.0/0" in cidrs or "::/0" in cidrs:
            found.append(f"open to the internet: {rule}")
        elif cidrs and (ports is None or ports & PRIVATE_PORTS):
            found.append(f"exposes a private port: {rule}")
    return found


def test_aws_security_group_opens_nothing_private():
    cfg = load("cluster.yaml")
    assert "security_group" in cfg["provider"]
    assert exposures(cfg) == []


@pytest.mark.parametrize("rule", [
    {"FromPort": 5000, "ToPort": 5000, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]},
    {"FromPort": 8000, "ToPort": 9000, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "203.0.113.7/32"}]},
    {"FromPort": -1, "ToPort": -1, "IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]},
])
def test_security_check_catches_exposures(rule):
    cfg = load("cluster.yaml")
    cfg["provider"]["security_group"]["IpPermissions"] = [rule]
    assert exposures(cfg)


@pytest.mark.parametrize("name", CONFIGS)
def test_dashboard_binds_localhost_only(name):
    cfg = load(name)
    [(cmd, opts)] = ray_starts(cfg, "head_start_ray_commands")
    assert opts.get("--dashboard-host") == "127.0.0.1", cmd
    assert opts.get("--dashboard-port", "8265") == "8265"
    assert "--ray-client-server-port" not in opts


@pytest.mark.parametrize("name", CONFIGS)
def test_mlflow_server_on_the_head(name):
    cfg = load(name)
    [(cmd, opts)] = mlflow_servers(cfg)
    assert cmd in cfg["head_start_ray_commands"], "the tracking server runs on the head"
    assert re.search(r"&\s*echo \$! >", cmd), "started in the background, pid recorded"
    assert opts["--backend-store-uri"].startswith("sqlite:////") or opts["--backend-store-uri"].startswith(
        "sqlite:///$HOME/")
    assert opts.get("--artifacts-destination")
    assert opts.get("--port") == "5000"
    assert "--disable-security-middleware" not in opts
    assert opts.get("--allowed-hosts") not in ("*",) and opts.get("--cors-allowed-origins") not in ("*",)
    host = opts.get("--host", "127.0.0.1")
    # MLflow has no authentication here: never all interfaces, only the head's private address.
    assert host not in ("0.0.0.0", "::", "*", "[::]")
    if cfg["provider"]["type"] == "local":
        assert host == "$HEAD_IP" and head_ip_of(cmd, cfg) == cfg["provider"]["head_ip"]
    else:
        # The head's private address, found the same way as the MLFLOW_TRACKING_URI the nodes log to.
        assert host == "$HEAD_IP"
        assert re.search(r"HEAD_IP=\$\(hostname -I \| awk '\{print \$1\}'\)", cmd)
        [(start_cmd, _)] = ray_starts(cfg, "head_start_ray_commands")
        assert "MLFLOW_TRACKING_URI=http://$(hostname -I | awk '{print $1}'):5000" in start_cmd


@pytest.mark.parametrize("name", CONFIGS)
def test_token_auth_reaches_every_node(name):
    cfg = load(name)
    assert cfg["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [(cmd, _)] = ray_starts(cfg, key)
        assert re.search(r"RAY_AUTH_MODE=token\b.*ray start", cmd), cmd


@pytest.mark.parametrize("name", CONFIGS)
def test_jobs_log_to_the_head_mlflow_server(name):
    cfg = load(name)
    [(head_cmd, _)] = ray_starts(cfg, "head_start_ray_commands")
    [(worker_cmd, _)] = ray_starts(cfg, "worker_start_ray_commands")
    uri = re.compile(r"MLFLOW_TRACKING_URI=http://(.+?):5000\b.*ray start")
    head_host = uri.search(head_cmd).group(1)
    assert uri.search(worker_cmd).group(1) == "$RAY_HEAD_IP"
    if cfg["provider"]["type"] == "local":
        assert head_host == "$HEAD_IP" and head_ip_of(head_cmd, cfg) == cfg["provider"]["head_ip"]


# --- NFS ----------------------------------------------------------------------------------------------

BROAD = ("*", "0.0.0.0", "::/0", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")


def nfs_export_problems(cfg: dict) -> list[str]:
    """What is wrong with the head's NFS export: it must go to the head's own subnet (read from the instance
    metadata into $SUBNET) and nowhere else, with root squashed."""
    cmds = [c for c in all_commands(cfg) if "/etc/exports" in c and "tee" in c]
    if len(cmds) != 1:
        return [f"expected one command writing /etc/exports, found {len(cmds)}"]
    cmd = cmds[0]
    lines = re.findall(r'echo "(/home/ubuntu/rayfl-shared [^"]*)"', cmd) + \
        re.findall(r"echo '(/home/ubuntu/rayfl-shared [^']*)'", cmd)
    if len(lines) != 1:
        return [f"expected one export line, found {lines}"]
    problems = []
    clients = lines[0].split()[1:]
    if clients != ["$SUBNET(rw,sync,no_subtree_check,root_squash)"]:
        problems.append(f"exported to {clients}, not the cluster subnet only")
    if any(b in lines[0] for b in BROAD) or "no_root_squash" in lines[0] or "insecure" in lines[0]:
        problems.append(f"too wide: {lines[0]}")
    if "subnet-ipv4-cidr-block" not in cmd or not re.search(r"SUBNET=\$\(curl -sSf", cmd):
        problems.append("SUBNET is not the head's subnet from the instance metadata")
    if "grep -Eq" not in cmd:
        problems.append("an empty or odd SUBNET is not refused")
    if "," in str(cfg["provider"].get("availability_zone", "")):
        problems.append("nodes in several zones (subnets) while NFS exports to one")
    return problems


def test_nfs_exports_to_the_cluster_subnet_only():
    assert nfs_export_problems(load("cluster.yaml")) == []


@pytest.mark.parametrize("line", [
    "/home/ubuntu/rayfl-shared 10.0.0.0/8(rw,sync,no_subtree_check)",
    "/home/ubuntu/rayfl-shared *(rw,sync,no_subtree_check)",
    "/home/ubuntu/rayfl-shared $SUBNET(rw,sync,no_subtree_check,no_root_squash)",
])
def test_nfs_check_catches_wide_exports(line):
    cfg = load("cluster.yaml")
    cfg["head_setup_commands"] = [re.sub(r'echo "/home/ubuntu/rayfl-shared [^"]*"', f'echo "{line}"', c)
                                  for c in cfg["head_setup_commands"]]
    assert nfs_export_problems(cfg)


def test_nfs_check_catches_two_zones():
    cfg = load("cluster.yaml")
    cfg["provider"]["availability_zone"] = "us-west-2a,us-west-2b"
    assert nfs_export_problems(cfg)


# --- right the first time (on-premise) ------------------------------------------------------------------

def _fake_bin(folder: pathlib.Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def _run(cmd: str, home: pathlib.Path, bin_dir: pathlib.Path, **env) -> subprocess.CompletedProcess:
    path = f"{bin_dir}:{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60,
                          env={"HOME": str(home), "PATH": path, **env})


def test_the_head_address_is_written_once():
    """Only provider.head_ip names the head: no command holds an address of its own."""
    cfg = load("onprem.yaml")
    text = "\n".join(line.split("#", 1)[0] for line in (CLUSTER_DIR / "onprem.yaml").read_text().splitlines())
    addresses = [a for a in re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", text) if not a.startswith("127.")]
    assert sorted(addresses) == sorted([cfg["provider"]["head_ip"], *cfg["provider"]["worker_ips"]])
    [(start, opts)] = ray_starts(cfg, "head_start_ray_commands")
    assert opts.get("--node-ip-address") == "$HEAD_IP" and head_ip_of(start, cfg) == cfg["provider"]["head_ip"]


def test_every_worker_starts_under_the_v1_autoscaler_whatever_ray_up_exports():
    """`ray up` prefixes the head's start commands with RAY_enable_autoscaler_v2=1 (its default since Ray
    2.50), under which the local provider starts one worker only; the head's `ray start` must see 0."""
    from ray.autoscaler._private.util import with_envs

    cfg = load("onprem.yaml")
    [(start, _)] = ray_starts(cfg, "head_start_ray_commands")
    [prefixed] = with_envs([start], {"RAY_enable_autoscaler_v2": "1", "RAY_NODE_TYPE_NAME": "x"})
    out = subprocess.run(["bash", "-c", 'ray() { echo "v2=$RAY_enable_autoscaler_v2"; }; ' + prefixed],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                              "SSH_CONNECTION": "192.0.2.7 1 10.0.0.10 22"})
    assert out.stdout.strip() == "v2=0", out.stderr
    assert "autoscaler v2" in (CLUSTER_DIR / "onprem.yaml").read_text()


def test_ray_down_stops_ray_on_every_worker(tmp_path):
    """`ray down` runs `ray stop` in the head's login shell (after ~/.bashrc): the function the head's setup
    adds there stops Ray on every worker over SSH first, with the key and user of the launcher's copy of the
    config, then on the head."""
    cfg = load("onprem.yaml")
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    (home / "rayfl").mkdir(parents=True)
    bin_dir.mkdir()
    (home / "rayfl" / "cluster").symlink_to(CLUSTER_DIR)
    (home / ".bashrc").write_text("")
    bootstrap = prepare_config(copy.deepcopy(cfg))
    bootstrap["auth"]["ssh_private_key"] = "~/ray_bootstrap_key.pem"
    (home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(bootstrap))
    log = tmp_path / "calls"
    _fake_bin(bin_dir, "ssh", f'echo "ssh $*" >> {log}')
    _fake_bin(bin_dir, "ray", f'echo "ray $*" >> {log}')
    for cmd in cfg["head_setup_commands"] * 2:  # run twice, as two `ray up`: added once
        assert _run(cmd, home, bin_dir).returncode == 0
    out = _run("source ~/.bashrc; ray stop", home, bin_dir)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    user = cfg["auth"]["ssh_user"]
    for ip in cfg["provider"]["worker_ips"]:
        [call] = [c for c in calls if f"{user}@{ip} " in c]
        assert f"-i {home}/ray_bootstrap_key.pem" in call and call.endswith('"source ~/.bashrc; ray stop"'), call
    assert calls[-1] == "ray stop" and len(calls) == len(cfg["provider"]["worker_ips"]) + 1
    [restart] = [c for c in cfg["head_start_ray_commands"] if "ray stop" in c]
    assert restart == "command ray stop"  # `ray up` restarts the head alone
    # and a stop command answered by no worker says so, without failing `ray down`
    _fake_bin(bin_dir, "ssh", "exit 255")
    out = _run("source ~/.bashrc; ray stop", home, bin_dir)
    assert out.returncode == 0 and out.stderr.count("could not stop Ray on worker") == 2, out.stderr


@pytest.mark.parametrize("name", CONFIGS)
def test_every_piped_step_sets_pipefail_and_a_failed_download_fails_its_step(name, tmp_path):
    cfg = load(name)
    for cmd in all_commands(cfg):
        if re.search(r"[^|]\|[^|]", cmd.replace("'{print $1}'", "")):
            assert cmd.startswith("set -o pipefail;"), cmd
    [uv] = [c for c in cfg["setup_commands"] if "install.sh" in c]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_bin(bin_dir, "curl", "exit 22")  # the download fails
    _fake_bin(bin_dir, "sh", "cat > /dev/null")  # and the shell it is piped to reads nothing and succeeds
    assert _run(uv, tmp_path, bin_dir).returncode != 0


@pytest.mark.parametrize("name", CONFIGS)
def test_the_token_file_is_readable_by_its_owner_only(name, tmp_path):
    (tmp_path / ".ray").mkdir()
    token = tmp_path / ".ray" / "auth_token"
    token.write_text("secret")
    token.chmod(0o644)
    [step] = [c for c in load(name)["setup_commands"] if "auth_token" in c]
    assert _run(step, tmp_path, tmp_path).returncode == 0
    assert token.stat().st_mode & 0o777 == 0o600 and (tmp_path / ".ray").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("name", CONFIGS)
def test_torch_and_mlflow_are_pinned_beside_ray(name):
    from importlib.metadata import version

    setup = " ".join(load(name)["setup_commands"])
    for package in ("torch", "torchvision", "mlflow"):
        pinned = re.findall(rf'"{package}==([0-9.]+)"', setup)
        assert pinned == [version(package).split("+")[0]], (package, pinned)
    assert re.findall(r"ray\[[^\]]*\]==([0-9.]+)", setup) == [ray.__version__]


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_up_fails_when_the_mlflow_server_does_not_answer(name, tmp_path):
    """A server that cannot bind its address exits at once: the step fails with the server's log, not later."""
    [cmd] = [c for c in load(name)["head_start_ray_commands"] if "mlflow server" in c]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_bin(bin_dir, "mlflow", 'echo "Errno 99: cannot assign requested address" >&2; exit 1')
    _fake_bin(bin_dir, "curl", "exit 7")
    _fake_bin(bin_dir, "hostname", "echo 10.0.0.10")
    out = _run(cmd, tmp_path, bin_dir, SSH_CONNECTION="192.0.2.7 1 10.0.0.10 22")
    assert out.returncode == 1 and "does not answer at 10.0.0.10:5000" in out.stdout, out.stdout + out.stderr
    assert "cannot assign requested address" in out.stdout
