"""rayfl at scale on one box: 1,000 clients (participation 0.1) and 10,000 clients (participation 0.01).

For each population: rayfl through its public path with the default (automatic) placement and MLflow
tracking on (and the CPU its tracking thread spent a round: the run's tag ``rayfl.tracking_cpu_seconds``, the
last batch of metrics included, over the rounds); the same run without MLflow (the cost of tracking is the
difference, within this machine's noise); the same rounds in
one process by the ``LocalRuntime`` (the target: at most 0.65x, ideal 0.5x on 2 cores); and
(``split``) two such processes with half the clients each, side by side: the same work on two cores with no
engine, what this machine allows an engine at best.
Steady round = median of rounds 2..end, training and evaluation of every client included; peak memory =
summed USS of the whole process tree (sampled every 0.2 s). Each measurement is its own fresh process.

Data: the real MNIST test set for 1,000 clients (10 images each); for 10,000 clients, random 28x28 images
(10 each; the real set has only 10,000). Model: the MLP 784-200-10 of bench_peers.py.

    .venv/bin/python benchmarks/bench_scale.py                       # both populations
    .venv/bin/python benchmarks/bench_scale.py --clients 1000 --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
from bench_peers import PeakMemory  # noqa: E402
from workload import steady, write_idx  # noqa: E402

MNIST = os.path.join(HERE, "..", "..", "shared", "datasets", "mnist-t10k")
PARTICIPATION = {1000: 0.1, 10000: 0.01}

WORKER = r'''
import json, sys, time, tempfile
T0 = time.time()
mode, values = sys.argv[1], json.loads(sys.argv[2])
from rayfl.config import make_config
from rayfl.experiment import prepare
prepared = prepare(make_config(None, values))
stamps, tracking_cpu = [], None
if mode == "local":
    import torch
    from rayfl.loop import Callback, Loop
    from rayfl.runtime import LocalRuntime
    torch.set_num_threads(1)
    class Stamp(Callback):
        def on_round(self, loop, record):
            stamps.append(time.time())
    Loop(prepared, LocalRuntime(prepared), [Stamp()]).run()
else:
    from rayfl.actors.launch import launch
    from rayfl.session import init_ray, shutdown_ray
    from rayfl.tracking import ensure_experiment
    init_ray(None)
    tracking = None
    if mode == "rayfl":
        tracking = {"tracking_uri": values["tracking_uri"], "run_name": "scale",
                    "experiment_id": ensure_experiment(values["tracking_uri"], "bench-scale")}
    out = launch(prepared, tracking, on_round=lambda rec: stamps.append(rec["time"]))
    shutdown_ray()
    if tracking:  # the writer's CPU over all rounds, as the run tagged it (its last batch included)
        from mlflow.tracking import MlflowClient
        tags = MlflowClient(values["tracking_uri"]).get_run(out["run_id"]).data.tags
        tracking_cpu = float(tags["rayfl.tracking_cpu_seconds"]) / len(stamps)
print("RESULT " + json.dumps({"stamps": stamps, "startup": stamps[0] - T0, "tracking_cpu": tracking_cpu}), flush=True)
'''


def workload(clients: int, data_root: str, rounds: int) -> dict:
    """The rayfl config of this benchmark for ``clients`` clients (``cpu_share.py`` measures the same)."""
    return {"algo": "fedavg", "dataset": "mnist", "data_root": os.path.abspath(data_root), "partition": "iid",
            "clients": clients, "samples_per_client": 10, "participation": PARTICIPATION[clients],
            "model": "mlp-784-200", "rounds": rounds, "lr": 0.05, "batch_size": 32, "experiment": "bench-scale"}


def measure(mode: str, values: dict, timeout: float) -> dict:
    """One mode's steady round, peak memory and time to its first round. ``split``: two ``local`` processes
    with half the clients each, started together and never talking: what two cores give this work with no
    engine at all (its round: the slower half's; its memory: both)."""
    if mode == "split":
        half = {**values, "clients": values["clients"] // 2}
        a, b = run_workers("local", [half, half], timeout)
        return {"steady": max(a["steady"], b["steady"]), "peak": a["peak"] + b["peak"],
                "startup": max(a["startup"], b["startup"]), "wall": max(a["wall"], b["wall"])}
    return run_workers(mode, [values], timeout)[0]


def run_workers(mode: str, each: list[dict], timeout: float) -> list[dict]:
    """Worker processes started together, one per ``values`` in ``each``, each in a fresh directory."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    with contextlib.ExitStack() as stack:
        started = []
        for values in each:
            cwd = stack.enter_context(tempfile.TemporaryDirectory())
            values = {**values, "tracking_uri": f"sqlite:///{cwd}/mlflow.db"}
            proc = subprocess.Popen([sys.executable, "-c", WORKER, mode, json.dumps(values)], cwd=cwd, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append((proc, stack.enter_context(PeakMemory(proc.pid)), time.time()))
        results = []
        for proc, mem, t0 in started:
            out, _ = proc.communicate(timeout=timeout)
            wall = time.time() - t0  # mem.peak only grows: read it while its sampler still runs
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{mode} failed (exit {proc.returncode}):\n" + "\n".join(out.splitlines()[-15:]))
            r = json.loads(lines[-1][len("RESULT "):])
            results.append({"steady": steady(r["stamps"]), "peak": mem.peak, "startup": r["startup"], "wall": wall,
                            "tracking_cpu": r["tracking_cpu"]})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000], choices=sorted(PARTICIPATION))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", default="rayfl,no-mlflow,local")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the interleaved modes (ratios: median "
                                                         "of each repetition's own ratio)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as random_root:
        rows: dict[tuple, list] = {}
        for k in args.clients:
            root = MNIST
            if k > 1000 or not os.path.isdir(MNIST):
                root = random_root
                write_idx(root, 10 * k)
            values = workload(k, root, args.rounds)
            for rep in range(args.reps):
                for mode in modes:
                    r = measure(mode, values, args.timeout)
                    rows.setdefault((k, mode), []).append(r)
                    cpu = r.get("tracking_cpu")
                    tracked = (f"  tracking CPU {cpu * 1000:.1f} ms/round ({cpu / r['steady']:.0%} of a round)"
                               if cpu is not None else "")
                    print(f"rep {rep + 1} {k:6d} clients  {mode:9s}  {r['steady']:.3f} s/round  peak "
                          f"{r['peak'] / 2**30:.2f} GiB  first round after {r['startup']:.1f} s  wall {r['wall']:.0f} s"
                          f"{tracked}", flush=True)
    print()
    for k in args.clients:
        def ratios(a: str, b: str) -> str:
            each = [x["steady"] / y["steady"] for x, y in zip(rows[(k, a)], rows[(k, b)])]
            return f"{statistics.median(each):.2f} (each repetition: {', '.join(f'{r:.2f}' for r in each)})"

        if "rayfl" in modes and "local" in modes:
            print(f"{k} clients: rayfl/LocalRuntime = {ratios('rayfl', 'local')}")
        if "split" in modes and "local" in modes:
            print(f"{k} clients: split/LocalRuntime = {ratios('split', 'local')} (two cores with no engine: the "
                  "ceiling on this machine)")
        if "rayfl" in modes and "no-mlflow" in modes:
            print(f"{k} clients: rayfl/no-MLflow = {ratios('rayfl', 'no-mlflow')} (tracking's cost: the excess over 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
