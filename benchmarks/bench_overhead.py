"""rayfl against a plain single-process torch loop doing the same FedAvg work, in one run.

Same federation, model, initial weights, local epochs, batch size and training function; the plain
loop trains the clients one after another in this process and averages; rayfl runs them in client
actors. Printed: median round time (training + aggregation, evaluation excluded on both sides),
their ratio, and the peak memory (USS summed over this process and all its children, sampled).

    .venv/bin/python benchmarks/bench_overhead.py                       # MNIST-t10k if present, else digits
    .venv/bin/python benchmarks/bench_overhead.py --clients 15 100 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rayfl.actors.resources import ActorResources, check_fits  # noqa: E402
from rayfl.config import UserError, make_config  # noqa: E402
from rayfl.experiment import prepare  # noqa: E402
from rayfl.training import load_vector, loss_fn_for, make_optimizer, to_vector, train_epochs, weighted_average  # noqa: E402

MNIST = "/work/shared/datasets/mnist-t10k"


class PeakMemory:
    """Peak of the summed USS of this process and its children (Ray's raylet, workers, actors)."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _sample(self) -> int:
        total = 0
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_full_info().uss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def __enter__(self):
        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._sample())
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def plain_loop(prepared, rounds: int) -> list[float]:
    """FedAvg as one would write it in a single script: every client trained in turn."""
    from rayfl.data import materialize

    cfg, ds = prepared.cfg, prepared.dataset
    data = [materialize(ds.x, ds.y, c) for c in prepared.federation.clients]
    model = prepared.model_spec.build()
    gens = [torch.Generator().manual_seed(cfg.seed * 1000 + i) for i in range(cfg.clients)]
    global_vec = prepared.initial
    loss_fn = loss_fn_for(prepared.info.task)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        vecs, sizes = [], []
        for i, d in enumerate(data):
            load_vector(model, global_vec)
            x, y = d["train"]
            opt = make_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)
            train_epochs(model, x, y, cfg.local_epochs, cfg.batch_size, opt, loss_fn, gens[i])
            vecs.append(to_vector(model))
            sizes.append(x.shape[0])
        global_vec = weighted_average(vecs, sizes)
        times.append(time.perf_counter() - t0)
    return times


def rayfl_loop(prepared, rounds: int) -> tuple[list[float], list[float]]:
    import ray

    from rayfl.actors.launch import launch
    from rayfl.tracking import ensure_experiment

    uri = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    exp = ensure_experiment(uri, "bench")
    arrivals = []
    result = launch(prepared, {"tracking_uri": uri, "experiment_id": exp, "run_name": "bench"},
                    on_round=lambda rec: arrivals.append(time.perf_counter()), poll_seconds=0.1)
    rounds_s = [h["round_seconds"] for h in result["history"]]
    return rounds_s, list(np.diff(arrivals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[15, 100])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="mlp-784-100")
    ap.add_argument("--plain-threads", type=int, default=1,
                    help="torch threads of the plain loop (rayfl actors use 1 each)")
    ap.add_argument("--clients-per-actor", type=int, nargs="+", default=[1, 0],
                    help="0: ceil(clients / CPUs), i.e. one actor per core")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    dataset = {"dataset": "mnist", "data_root": MNIST} if os.path.isdir(MNIST) else {"dataset": "digits"}
    model = args.model if dataset["dataset"] == "mnist" else "mlp-small"
    cpus = os.cpu_count() or 1
    torch.set_num_threads(args.plain_threads)
    print(f"data {dataset['dataset']}, model {model}, {args.rounds} rounds, 1 local epoch, batch 32, "
          f"{cpus} CPUs, plain loop torch threads {torch.get_num_threads()}")
    print("| clients | clients/actor | actors | plain s/round | rayfl s/round | ratio | rayfl wall s/round | "
          "plain peak MiB | rayfl peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.clients:
        for cpa in args.clients_per_actor:
            per_actor = cpa or -(-n // cpus)
            cfg = make_config(None, {**dataset, "model": model, "algo": "fedavg", "partition": "pathological",
                                     "clients": n, "rounds": args.rounds, "eval_every": 10_000, "lr": 0.05,
                                     "clients_per_actor": per_actor, "torch_threads": 1})
            prepared = prepare(cfg)
            n_actors = -(-n // per_actor)
            try:
                check_fits(ActorResources(0.01, 0.0), n_actors, {"CPU": cpus, "memory": 0.7 * psutil.virtual_memory().available}, n)
            except UserError as e:
                print(f"| {n} | {per_actor} | {n_actors} | - | does not fit: {e} | | | | |", flush=True)
                continue
            with PeakMemory() as plain_mem:
                plain = plain_loop(prepared, args.rounds)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
            try:
                with PeakMemory() as ray_mem:
                    rounds_s, wall = rayfl_loop(prepared, args.rounds)
            finally:
                ray.shutdown()
            # The first round of each side is left out (warm caches); medians resist the shared machine.
            p, r = statistics.median(plain[1:]), statistics.median(rounds_s[1:])
            w = statistics.median(wall[1:]) if len(wall) > 1 else float("nan")
            print(f"| {n} | {per_actor} | {n_actors} | {p:.3f} | {r:.3f} | {r / p:.2f}x | {w:.3f} | "
                  f"{plain_mem.peak / 2**20:.0f} | {ray_mem.peak / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
