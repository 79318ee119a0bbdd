"""Fault soak: runs with a client actor or the driver killed (SIGKILL) at a random round must all finish
with the uninterrupted run's metrics.

One uninterrupted run, then ``--client-kills`` runs that each kill one random client actor's process after
a random round (found through the run's own placement record in MLflow), and ``--driver-kills`` runs that
each kill the driver actor's process (its pid comes with every round record), with a checkpoint every
round. A random delay of up to ``--jitter`` seconds puts the kill at a random point of the next round.

    .venv/bin/python benchmarks/fault_soak.py                              # 10 client kills, 5 driver kills
    .venv/bin/python benchmarks/fault_soak.py --client-kills 2 --driver-kills 1 --algo fedavg
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
    args = ap.parse_args()

    import ray
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="rayfl-soak-")
    uri = f"sqlite:///{work}/mlflow.db"
    exp = ensure_experiment(uri, "fault-soak")
    values = {"algo": args.algo, "dataset": "synthetic", "partition": "iid", "clients": args.clients,
              "rounds": args.rounds, "samples_per_client": 60, "lr": 0.1, "batch_size": 16,
              "clients_per_actor": args.clients_per_actor, "params": ALGO_PARAMS.get(args.algo, {})}
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
        return 0 if ok == len(plan) else 1
    finally:
        ray.shutdown()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
