"""Time of a PersFL λ x T grid sweep with and without sharing stage 1 across the (λ, T) trials.

Each sweep is one `rayfl tune` process with its own private Ray instance (run one after the other, in
alternating order over --repeats, so both see the same machine load). With reuse, the first trial computes
stage 1 (FedAvg + each client's teacher) and writes the cache; the others wait for it and run only stage 2.

    python benchmarks/bench_tune_reuse.py                       # 2 x 2 grid, 10 rounds, 2 at once
    python benchmarks/bench_tune_reuse.py --dataset mnist --data-root ../shared/datasets/mnist-t10k \
        --clients 10 --clients-per-actor 5 --samples-per-client 400 --rounds 20 --local-epochs 2 --lam 0 0.5 1 --T 1 5

Prints a markdown table (paste it into benchmarks/results_tune.md with the command).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import pandas as pd


def sweep(tmp: str, name: str, args, reuse: bool) -> dict:
    space = os.path.join(tmp, "space.yaml")
    with open(space, "w") as f:
        f.write(f"grid:\n  lam: {list(args.lam)}\n  T: {list(args.T)}\n")
    cmd = [sys.executable, "-m", "rayfl.cli", "tune", "--algo", "persfl", "--space", space,
           "--dataset", args.dataset, "--partition", "pathological", "--clients", str(args.clients),
           "--rounds", str(args.rounds), "--local-epochs", str(args.local_epochs), "--samples-per-client", str(args.samples_per_client),
           "--clients-per-actor", str(args.clients_per_actor), "--max-concurrent", str(args.max_concurrent),
           "--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "--storage-path", os.path.join(tmp, "tune"),
           "--name", name, "--quiet"] + ([] if reuse else ["--no-stage1-reuse"])
    cmd += ["--data-root", args.data_root] if args.data_root else []
    cmd += ["--model", args.model] if args.model else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    table = pd.read_csv(os.path.join(tmp, "tune", name, "results.csv"))
    return {"wall": wall, "trial_seconds": float(table.seconds.sum()), "trials": len(table),
            "val_acc": dict(zip(zip(table.lam, table["T"]), table.val_acc_mean)),
            "test_acc": dict(zip(zip(table.lam, table["T"]), table.test_acc_mean))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lam", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--T", type=float, nargs="+", default=[1.0, 5.0])
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--data-root", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--samples-per-client", type=int, default=100)
    p.add_argument("--clients-per-actor", type=int, default=2)
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            for reuse in order:
                res = sweep(tmp, f"{'reuse' if reuse else 'noreuse'}-{r}", args, reuse)
                rows.append({"reuse": reuse, **res})
                print(f"repeat {r} reuse={reuse}: {res['wall']:.1f} s wall, {res['trial_seconds']:.1f} s in trials",
                      file=sys.stderr, flush=True)
    with_ = [r for r in rows if r["reuse"]]
    without = [r for r in rows if not r["reuse"]]
    same = all(a["val_acc"] == b["val_acc"] and a["test_acc"] == b["test_acc"] for a, b in zip(with_, without))
    n = len(args.lam) * len(args.T)
    print(f"| grid | stage 1 | sweep wall (s) | sum of trial times (s) |\n|---|---|---|---|")
    for label, rs in (("shared (one stage 1)", with_), (f"per trial ({n} stage 1s)", without)):
        walls = " / ".join(f"{r['wall']:.1f}" for r in rs)
        trials = " / ".join(f"{r['trial_seconds']:.1f}" for r in rs)
        print(f"| {len(args.lam)} x {len(args.T)} λ x T | {label} | {walls} | {trials} |")
    ratio = sum(r["wall"] for r in without) / sum(r["wall"] for r in with_)
    tratio = sum(r["trial_seconds"] for r in without) / sum(r["trial_seconds"] for r in with_)
    print(f"\nwall time without / with reuse: {ratio:.2f}x; trial time: {tratio:.2f}x; "
          f"identical per-trial val/test accuracy with and without reuse: {same}")


if __name__ == "__main__":
    main()
