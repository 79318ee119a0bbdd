"""What the per-round in-memory snapshot costs on an MLP FedAvg workload (MNIST-t10k, mlp-784-100).

Two measurements, both as a fraction of a round:

1. In one process, for one actor's share of the clients: the time ``ClientHost.state()`` takes (what a
   client actor does for the snapshot: every client's model, optimizer, personal state and RNGs to
   plain-data bytes) against the time of one FedAvg round of the same clients on the same host (training).
2. On Ray, the same federation run with ``snapshot_every=1`` and ``snapshot_every=0``, alternately
   (``--repeats`` pairs): the median round time (training + aggregation + the snapshot; evaluation left
   out) of each, and the driver-side ``snapshot_seconds``.

    .venv/bin/python benchmarks/snapshot_cost.py                      # 15 and 100 clients, one actor per core
    .venv/bin/python benchmarks/snapshot_cost.py --clients 100 --rounds 8 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rayfl.config import make_config  # noqa: E402
from rayfl.experiment import prepare  # noqa: E402

MNIST = "/work/shared/datasets/mnist-t10k"


def in_process(prepared, per_actor: int, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of one FedAvg training round and of one state() call, for one host of per_actor clients."""
    from rayfl.host import ClientHost

    fed = prepared.federation
    host = ClientHost(prepared.host_spec(), {c: fed.clients[c] for c in range(per_actor)})
    items = [(c, {"models": {"global": prepared.initial}}) for c in range(per_actor)]
    rounds, states = [], []
    host.run("train", items), host.state()  # warm-up: torch's and numpy's first-call costs
    for _ in range(repeats):
        t0 = time.perf_counter()
        host.run("train", items)
        t1 = time.perf_counter()
        host.state()
        t2 = time.perf_counter()
        rounds.append(t1 - t0)
        states.append(t2 - t1)
    return statistics.median(rounds), statistics.median(states)


def on_ray(prepared, snapshot_every: int) -> tuple[list[float], list[float]]:
    import dataclasses

    from rayfl.actors.launch import launch
    from rayfl.tracking import ensure_experiment

    p = dataclasses.replace(prepared, cfg=dataclasses.replace(prepared.cfg, snapshot_every=snapshot_every))
    uri = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    arrivals = []
    result = launch(p, {"tracking_uri": uri, "experiment_id": ensure_experiment(uri, "bench"), "run_name": "s"},
                    on_round=lambda rec: arrivals.append(time.perf_counter()), poll_seconds=0.02)
    rounds = [h["round_seconds"] + h.get("snapshot_seconds", 0.0) for h in result["history"]][1:]
    return rounds, [h.get("snapshot_seconds", 0.0) for h in result["history"]][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[15, 100])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="pairs of Ray runs (with, without snapshots)")
    ap.add_argument("--model", default="mlp-784-100")
    ap.add_argument("--no-ray", action="store_true", help="only the in-process measurement (1.)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    dataset = {"dataset": "mnist", "data_root": MNIST} if os.path.isdir(MNIST) else {"dataset": "digits"}
    model = args.model if dataset["dataset"] == "mnist" else "mlp-small"
    cpus = os.cpu_count() or 1
    print(f"data {dataset['dataset']}, model {model}, FedAvg, {args.rounds} rounds, {cpus} CPUs, one actor per core")
    print("| clients | clients/actor | state() s | train round s (same host) | state/round | "
          "Ray s/round with | without | ratio | driver snapshot s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.clients:
        per_actor = -(-n // cpus)
        cfg = make_config(None, {**dataset, "model": model, "algo": "fedavg", "partition": "pathological",
                                 "clients": n, "rounds": args.rounds, "eval_every": 10_000, "lr": 0.05,
                                 "clients_per_actor": per_actor, "torch_threads": 1})
        prepared = prepare(cfg)
        train_s, state_s = in_process(prepared, per_actor)
        if args.no_ray:
            print(f"| {n} | {per_actor} | {state_s:.4f} | {train_s:.4f} | {state_s / train_s:.1%} | - | - | - | - |",
                  flush=True)
            continue
        with_s, without_s, driver_s = [], [], []
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
        try:
            for _ in range(args.repeats):
                r, d = on_ray(prepared, 1)
                with_s += r
                driver_s += d
                without_s += on_ray(prepared, 0)[0]
        finally:
            ray.shutdown()
        w, wo = statistics.median(with_s), statistics.median(without_s)
        print(f"| {n} | {per_actor} | {state_s:.4f} | {train_s:.4f} | {state_s / train_s:.1%} | {w:.3f} | {wo:.3f} | "
              f"{w / wo:.3f}x | {statistics.median(driver_s):.4f} |", flush=True)


if __name__ == "__main__":
    main()
