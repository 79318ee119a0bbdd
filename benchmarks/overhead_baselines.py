"""The baselines' round against FedAvg's on the ``mlp10`` workload, beside each one's floor by arithmetic.

Each algorithm runs through rayfl's public path on Ray (``peers/run_rayfl.py``: default placement, MLflow on),
the runs interleaved (every algorithm once, then again), the steady round being the median of the round walls
from round 2 on, the ratio that of the medians over repetitions. The floor is what the algorithm's paper makes
a client compute in a round against FedAvg's, counted in sample-passes (a forward pass of one sample is 1; a
training sample costs 3: forward, backward, step), on this workload: 10 clients of 543 training, 181
validation and 181 test samples (the 10,000 random images less the 950 held out), one epoch of batches of 32
(17 batches), every client every round.

    .venv/bin/python benchmarks/overhead_baselines.py --reps 2 --rounds 8

The oracle needs groups: it and a FedAvg of its own run with ``partition=latent, groups=2``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
from bench_peers import run_retried  # noqa: E402
from workload import write_idx  # noqa: E402

TRAIN, VAL, TEST, BATCH = 543, 181, 181, 32
BATCHES = math.ceil(TRAIN / BATCH)
FEDAVG = 3 * TRAIN + VAL + TEST  # 1,991: train one epoch, evaluate on validation and test


def floor(passes: float) -> float:
    return passes / FEDAVG


# algorithm -> (extra config values, floor x FedAvg, how the floor is counted)
ROWS = {
    "fedavg": ({}, 1.0, "the reference"),
    "fedprox": ({}, 1.0, "FedAvg's passes; the proximal term is a vector operation per step"),
    "fedavg-data": ({}, floor(3 * (TRAIN + 27 * 10) + VAL + TEST),
                    "training on 543 + |G| = 270 samples (5% of the clients' 5,430, all of G to every client)"),
    "lg-fedavg": ({}, 1.0, "FedAvg's passes (each client evaluated on its own model)"),
    "fedper": ({}, 1.0, "FedAvg's passes (each client evaluated on its own model)"),
    "mocha": ({}, 1.0, "FedAvg's passes; the head's regularizer step and Omega's update are vector operations"),
    "cfl": ({}, 1.0, "FedAvg's passes; each cluster averaged by the hosts, the similarities only where a split is examined"),
    "perfedavg": ({}, floor(2 * (BATCHES // 2) * BATCH * 3 + 3 * BATCH + VAL + TEST + TEST),
                  "8 FO steps of 2 batches, one adaptation step before the evaluation, the global model on test too"),
    "pfedme": ({}, floor(5 * BATCHES * BATCH * 3 + VAL + TEST + TEST),
               "K = 5 inner steps on each of the 17 batches; the personalized and the global model evaluated"),
    "fedem": ({}, floor(4 * 3 * TRAIN + 4 * TRAIN + 4 * (VAL + TEST)),
              "M = 4 components trained, an E-step pass of the 4 on the training split, a mixture of 4 evaluated"),
    "fedavg@groups": ({"partition": "latent", "groups": 2}, 1.0, "the oracle's reference"),
    "oracle": ({"partition": "latent", "groups": 2}, 1.0, "FedAvg's passes; each group averaged by the hosts"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--algos", default=",".join(ROWS))
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    names = args.algos.split(",")
    steady: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as data:
        write_idx(data, 10 * 1000)
        for rep in range(args.reps):
            for name in names:
                extra, _, _ = ROWS[name]
                sets = [f"algo={name.split('@')[0]}", *(f"{k}={v}" for k, v in extra.items())]
                run = run_retried("rayfl", "mlp10", data, args.rounds,
                                  SimpleNamespace(set=sets, timeout=args.timeout))
                steady[name].append(run["steady"])
                print(f"rep {rep + 1} {name}: {run['steady']:.3f} s/round", flush=True)
    print("\n| algorithm | s/round (repetitions) | x FedAvg (medians) | floor by arithmetic | ratio / floor | the floor |")
    print("|---|---|---|---|---|---|")
    for name in names:
        ref = "fedavg@groups" if ROWS[name][0] else "fedavg"
        ratio = statistics.median(steady[name]) / statistics.median(steady[ref]) if ref in steady else float("nan")
        _, fl, how = ROWS[name]
        print(f"| {name} | {', '.join(f'{s:.3f}' for s in steady[name])} | {ratio:.2f} | {fl:.2f} | "
              f"{ratio / fl:.2f} | {how} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
