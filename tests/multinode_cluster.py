"""A real multi-node Ray cluster on this one machine, for tests: ``ray.cluster_utils.Cluster`` in a helper
process, whose nodes a test can remove and add while a run goes on.

Isolation on a shared machine:
- The cluster lives in a helper process in its own session, with its own RAY_TMPDIR (Cluster writes
  ``ray_current_cluster`` into the default temp dir, which would capture other people's plain
  ``ray.init()``) and its own free ports; the caller's environment names its auth mode (and token).
- Every process started from here carries a marker in its environment (the private directory), so
  teardown finds what is left by pid: the helper's ``Cluster.shutdown()`` first, then SIGTERM/SIGKILL
  to the helper's process group, then any process whose command line or environment names the marker.
  Never `ray stop`, never a kill by process name.

The helper reads one JSON command a line on stdin and answers one JSON line on stdout:
``{"op": "remove", "node": ID}`` (the node's raylet and workers stopped, as a lost machine),
``{"op": "add", "num_cpus": N, ...}`` (a new worker node, as an autoscaler adds one; answers its id),
``{"op": "actors"}`` (the live actors: class, node, pid). End of input shuts the cluster down.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HELPER = textwrap.dedent("""
    import json, signal, sys
    from ray.cluster_utils import Cluster

    spec = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # turns SIGTERM into the finally below
    cluster = Cluster(initialize_head=True, head_node_args=spec["head"])
    connected = False
    try:
        nodes = {}
        for args in spec["workers"]:
            node = cluster.add_node(**args)
            nodes[node.node_id] = node
        cluster.wait_for_nodes()
        print(json.dumps({"head": cluster.head_node.node_id, "workers": list(nodes), "gcs": cluster.address}),
              flush=True)
        for line in sys.stdin:   # until the test closes our stdin
            cmd = json.loads(line)
            if cmd["op"] == "remove":
                cluster.remove_node(nodes.pop(cmd["node"]))
                answer = {"removed": cmd["node"]}
            elif cmd["op"] == "add":
                node = cluster.add_node(**{k: v for k, v in cmd.items() if k != "op"})
                cluster.wait_for_nodes()
                nodes[node.node_id] = node
                answer = {"added": node.node_id}
            elif cmd["op"] == "actors":
                import ray
                from ray._private.state import actors
                if not connected:
                    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
                    connected = True
                answer = {"actors": [{"class": a["ActorClassName"], "node": a["Address"]["NodeID"],
                                      "pid": a.get("Pid")}
                                     for a in actors().values() if a["State"] == "ALIVE"]}
            else:
                answer = {"error": f"unknown op {cmd['op']!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        if connected:
            import ray
            ray.shutdown()
        cluster.shutdown()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(root: str, **extra: str) -> dict:
    """The environment of every process a test starts against its cluster: its private temp dir and marker,
    the checkout importable, no address or tracking store of anyone else's."""
    env = {**os.environ, "RAY_TMPDIR": root, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "RFL_MULTINODE_TEST": root}  # marks every process started from here (see pids_naming)
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI"):  # never someone else's
        env.pop(key, None)
    env.update(extra)
    return env


def pids_naming(marker: str) -> list[int]:
    """Processes of ours whose command line or environment mentions ``marker`` (our private dir)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        for name in ("cmdline", "environ"):
            try:
                if marker.encode() in (entry / name).read_bytes():
                    found.append(int(entry.name))
                    break
            except OSError:
                pass
    return found


def alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie waiting for its parent has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1][:1] not in "ZX"
    except OSError:
        return False


def end_processes(pids: list[int]) -> list[int]:
    """SIGTERM to each pid, SIGKILL to what is left 5 s later; returns the pids that outlived both."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if alive(p)]
    return pids


def kill_leftovers(marker: str) -> tuple[list[int], list[int]]:
    """Kill what is left of ours; returns (found, survived)."""
    found = pids_naming(marker)
    return found, end_processes(found)


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of ``proc``'s stdout, or '' if it exits or says nothing in time."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                return proc.stdout.readline()
            if proc.poll() is not None:
                return ""
        return ""
    finally:
        sel.close()


class LocalCluster:
    """A head and worker nodes in a helper process (see the module's docstring); ``info``: the head's and
    workers' node ids and the GCS address."""

    def __init__(self, root: str, env: dict, head: dict, workers: list[dict], start_timeout: float = 240):
        self.root, self.env = root, env
        helper_file = Path(root) / "cluster_helper.py"
        helper_file.write_text(HELPER)
        self.log = open(Path(root) / "helper.log", "w+")
        spec = {"head": {"temp_dir": f"{root}/ray", **head}, "workers": workers}
        self.proc = subprocess.Popen([sys.executable, str(helper_file), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=root,
                                     start_new_session=True)
        line = readline(self.proc, start_timeout)
        if not line:
            self.close()
            raise RuntimeError(f"the Ray cluster did not come up:\n{self.log_tail()}")
        self.info = json.loads(line)
        self.workers = list(self.info["workers"])

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def ask(self, timeout: float = 60, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = readline(self.proc, timeout)
        if not line:
            raise RuntimeError(f"the cluster helper did not answer {cmd}:\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def remove(self, node: str) -> None:
        self.ask(op="remove", node=node)
        self.workers.remove(node)

    def add(self, **node_args) -> str:
        node = self.ask(op="add", **node_args)["added"]
        self.workers.append(node)
        return node

    def actors(self) -> list[dict]:
        return self.ask(op="actors")["actors"]

    def close(self) -> list[int]:
        """Shut the cluster down and kill whatever of ours is left; returns the pids that survived."""
        try:
            self.proc.stdin.close()  # the helper shuts its cluster down and exits
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        found, left = kill_leftovers(self.root)
        if found:
            print(f"teardown: killed {len(found)} process(es) left after the cluster's shutdown")
        self.log.close()
        return left


def private_root(prefix: str) -> str:
    """A fresh private directory, short: Ray's socket paths have a length limit."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def remove_root(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
