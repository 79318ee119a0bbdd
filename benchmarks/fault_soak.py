"""Fault soak: runs with a client actor or the driver killed (SIGKILL), or a node lost, at a random round must
all finish with the uninterrupted run's metrics.

One uninterrupted run, then ``--client-kills`` runs that each kill one random client actor's process after
a random round (found through the run's own placement record in MLflow), and ``--driver-kills`` runs that
each kill the driver actor's process (its pid comes with every round record), with a checkpoint every
round. A random delay of up to ``--jitter`` seconds puts the kill at a random point of the next round.

Node losses (``--node-losses``, ``--driver-node-losses``) run on a multi-node cluster on this machine
(``ray.cluster_utils.Cluster``: a head with no CPUs and ``--workers`` one-CPU workers, client actors of 0.9
CPU, so one per worker): one uninterrupted twin, then runs that each remove, after a random round, a worker
node hosting client actors and not the driver (or the driver's node), and add a fresh node back afterwards.

    .venv/bin/python benchmarks/fault_soak.py                              # 10 client kills, 5 driver kills
    .venv/bin/python benchmarks/fault_soak.py --client-kills 2 --driver-kills 1 --algo fedavg
    .venv/bin/python benchmarks/fault_soak.py --client-kills 0 --driver-kills 0 --node-losses 8 \
        --driver-node-losses 2 --clients 6 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rayfl.config import make_config  # noqa: E402
from rayfl.experiment import prepare  # noqa: E402
from rayfl.tracking import ensure_experiment  # noqa: E402

ALGO_PARAMS = {"fedfomo": {"M": 2}, "federico": {"M": 1}, "persfl": {"lam_grid": [0.0, 0.5], "T_grid": [1.0]}}


def results(history: list[dict]) -> list[dict]:
    """What a run computed: every metric but wall-clock times and the fault counter."""
    return [{k: v for k, v in h.items() if not k.endswith("seconds") and k != "client_restarts"} for h in history]


def same(a: list[dict], b: list[dict]) -> bool:
    ra, rb = results(a), results(b)
    return len(ra) == len(rb) and all(x.keys() == y.keys() and all(x[k] == y[k] or (x[k] != x[k] and y[k] != y[k])
                                                                   for k in x) for x, y in zip(ra, rb))


def client_pids(uri: str, exp: str, run_name: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.search_runs([exp], f"attributes.run_name = '{run_name}'")[0]
    path = client.download_artifacts(run.info.run_id, "placement.json")
    return [a["pid"] for a in json.load(open(path))["placement"]]


def one_run(cfg, uri: str, exp: str, name: str, kind: str | None, kill_after: int, jitter: float,
            rng: random.Random, checkpoint_dir: str | None) -> dict:
    from rayfl.actors.launch import launch

    killed: list[int] = []

    def kill_later(pid: int) -> None:
        time.sleep(rng.uniform(0, jitter))
        os.kill(pid, signal.SIGKILL)

    def on_round(rec: dict) -> None:
        if kind is None or killed or rec["step"] != kill_after:
            return
        pid = rec["driver_pid"] if kind == "driver" else rng.choice(client_pids(uri, exp, name))
        killed.append(pid)
        threading.Thread(target=kill_later, args=(pid,), daemon=True).start()

    t0 = time.time()
    out = launch(prepare(cfg), {"tracking_uri": uri, "experiment_id": exp, "run_name": name},
                 checkpoint_dir=checkpoint_dir, on_round=on_round, poll_seconds=0.02)
    return {"result": out, "killed": killed, "seconds": time.time() - t0}


def node_loss_soak(args, values: dict, rng: random.Random) -> tuple[int, int]:
    """Runs with a worker node removed after a random round, on a private multi-node cluster; (equal, runs)."""
    import ray
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    from rayfl.actors.launch import launch

    work = tempfile.mkdtemp(prefix="rfl-soak-", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ["RAY_TMPDIR"] = work  # Cluster writes ray_current_cluster there, not in everyone's /tmp/ray
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(key, None)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, temp_dir=f"{work}/ray"))
    nodes = {}
    try:
        for _ in range(args.workers):
            node = cluster.add_node(num_cpus=1)
            nodes[node.node_id] = node
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        uri = f"sqlite:///{work}/mlflow.db"
        exp = ensure_experiment(uri, "node-loss-soak")
        values = {**values, "cpus_per_actor": 0.9, "local_epochs": args.local_epochs}

        def one(name: str, kind: str | None, after: int, cfg) -> dict:
            placement, lost = [], []

            def on_event(e: dict) -> None:
                if e["event"] == "start" and not placement:
                    placement.extend(e["placement"])

            def on_round(rec: dict) -> None:
                if kind is None or lost or rec["step"] != after:
                    return
                if kind == "driver-node":
                    victim = rec["driver_node"]
                else:
                    hosts = sorted({a["node_id"] for a in placement} - {rec["driver_node"]})
                    victim = rng.choice(hosts)
                lost.append(victim)
                cluster.remove_node(nodes.pop(victim))

            t0 = time.time()
            ckpt = os.path.join(work, name)
            out = launch(prepare(cfg), {"tracking_uri": uri, "experiment_id": exp, "run_name": name},
                         checkpoint_dir=ckpt, on_round=on_round, on_event=on_event, poll_seconds=0.02,
                         cluster_may_grow=True)
            seconds = time.time() - t0
            while len(nodes) < args.workers:  # back to full size for the next run
                node = cluster.add_node(num_cpus=1)
                nodes[node.node_id] = node
            cluster.wait_for_nodes()
            return {"result": out, "lost": lost, "seconds": seconds}

        clean = one("twin", None, -1, make_config(None, values))
        n_steps = len(clean["result"]["history"])
        print(f"\nnode losses: {args.workers} one-CPU workers, client actors of 0.9 CPU; uninterrupted twin: "
              f"{n_steps} rounds in {clean['seconds']:.1f}s")
        print(f"{'run':>4} {'lost':>11} {'after round':>11} {'node':>10} {'client restarts':>15} "
              f"{'driver restarts':>15} {'MLflow':>9} {'equal':>6} {'seconds':>8}")
        plan = ["client-node"] * args.node_losses + ["driver-node"] * args.driver_node_losses
        ok = 0
        for i, kind in enumerate(plan):
            after = rng.randrange(0, n_steps - 2)
            cfg = make_config(None, {**values, "checkpoint_every": 1 if kind == "driver-node" else 0})
            try:
                r = one(f"{kind}-{i}", kind, after, cfg)
            except Exception as e:  # a run that did not survive is a result, not a crash of the soak
                print(f"{i:>4} {kind:>11} {after + 1:>11} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            run = MlflowClient(uri).get_run(r["result"]["run_id"])
            equal = same(r["result"]["history"], clean["result"]["history"])
            ok += bool(r["lost"]) and equal and run.info.status == "FINISHED"
            print(f"{i:>4} {kind:>11} {after + 1:>11} {(r['lost'] or ['none'])[0][:8]:>10} "
                  f"{r['result'].get('client_restarts', 0):>15} {run.data.tags.get('rayfl.driver_restarts', '0'):>15} "
                  f"{run.info.status:>9} {'yes' if equal else 'NO':>6} {r['seconds']:>8.1f}")
        print(f"\n{ok} of {len(plan)} runs with a node lost finished FINISHED with the uninterrupted twin's metrics")
        return ok, len(plan)
    finally:
        ray.shutdown()
        cluster.shutdown()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client-kills", type=int, default=10)
    ap.add_argument("--driver-kills", type=int, default=5)
    ap.add_argument("--algo", default="fedfomo")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--clients-per-actor", type=int, default=2)
    ap.add_argument("--jitter", type=float, default=0.3, help="seconds: the kill lands this far into a round at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-losses", type=int, default=0, help="runs that lose a worker node hosting client actors")
    ap.add_argument("--driver-node-losses", type=int, default=0, help="runs that lose the driver's node")
    ap.add_argument("--workers", type=int, default=4, help="one-CPU worker nodes of the node-loss cluster")
    ap.add_argument("--local-epochs", type=int, default=5, help="node losses: slower rounds, so that the loss lands "
                                                                "mid-run")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rng = random.Random(args.seed)
    values = {"algo": args.algo, "dataset": "synthetic", "partition": "iid", "clients": args.clients,
              "rounds": args.rounds, "samples_per_client": 60, "lr": 0.1, "batch_size": 16,
              "clients_per_actor": args.clients_per_actor, "params": ALGO_PARAMS.get(args.algo, {})}
    ok = total = 0
    if args.client_kills or args.driver_kills:
        ok, total = kill_soak(args, values, rng)
    if args.node_losses or args.driver_node_losses:
        more, runs = node_loss_soak(args, values, rng)
        ok, total = ok + more, total + runs
    return 0 if ok == total else 1


def kill_soak(args, values: dict, rng: random.Random) -> tuple[int, int]:
    """Runs with a process killed after a random round, on a private 2-CPU instance; (equal, runs)."""
    import ray
    from mlflow.tracking import MlflowClient

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    work = tempfile.mkdtemp(prefix="rayfl-soak-")
    uri = f"sqlite:///{work}/mlflow.db"
    exp = ensure_experiment(uri, "fault-soak")
    try:
        clean = one_run(make_config(None, values), uri, exp, "clean", None, -1, 0, rng, None)
        n_steps = len(clean["result"]["history"])
        print(f"uninterrupted: {n_steps} rounds in {clean['seconds']:.1f}s; {args.algo}, {args.clients} clients, "
              f"{args.clients_per_actor} per actor")
        print(f"{'run':>4} {'kill':>7} {'after round':>11} {'client restarts':>15} {'driver restarts':>15} "
              f"{'MLflow':>9} {'equal':>6} {'seconds':>8}")
        plan = ["client"] * args.client_kills + ["driver"] * args.driver_kills
        ok = 0
        for i, kind in enumerate(plan):
            after = rng.randrange(0, n_steps - 1)  # the kill lands in a later round
            name = f"{kind}-{i}"
            ckpt = os.path.join(work, name) if kind == "driver" else None
            cfg = make_config(None, {**values, "checkpoint_every": 1 if kind == "driver" else 0})
            try:
                r = one_run(cfg, uri, exp, name, kind, after, args.jitter, rng, ckpt)
            except Exception as e:  # a run that did not survive is a result, not a crash of the soak
                print(f"{i:>4} {kind:>7} {after + 1:>11} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            run = MlflowClient(uri).get_run(r["result"]["run_id"])
            equal = same(r["result"]["history"], clean["result"]["history"])
            ok += bool(r["killed"]) and equal and run.info.status == "FINISHED"
            print(f"{i:>4} {kind:>7} {after + 1:>11} {r['result'].get('client_restarts', 0):>15} "
                  f"{run.data.tags.get('rayfl.driver_restarts', '0'):>15} {run.info.status:>9} "
                  f"{'yes' if equal else 'NO':>6} {r['seconds']:>8.1f}")
        print(f"\n{ok} of {len(plan)} runs with a kill finished FINISHED with the uninterrupted run's metrics")
        return ok, len(plan)
    finally:
        ray.shutdown()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
