"""FedeRiCo (spec 002) reproduction, scaled down: FedeRiCo beside Local, FedAvg and FedAvg+ on disjoint label
groups (2, 3, 4 groups), 80/20 train/test per client, no validation split (the paper's FedeRiCo has none),
Adam lr 0.01 for every method (paper §5 "Training settings"), final round only, several seeds.

In-process (LocalRuntime, no Ray): the numbers do not depend on the runtime, and the machine is shared.

    .venv/bin/python benchmarks/repro_federico.py                      # digits, the table in results_federico.md
    .venv/bin/python benchmarks/repro_federico.py --dataset mnist --data-root /work/shared/datasets/mnist-t10k \
        --model mlp-784-100
    .venv/bin/python benchmarks/repro_federico.py --sine --rounds 300 [--loss-sum]   # Figure 1 toy

Reported per setting: the sample-weighted mean of per-client test accuracy (the paper's metric, spec P11) and
the worst client's, each as mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

sys.path.insert(0, ".")

from rayfl.config import make_config  # noqa: E402
from rayfl.experiment import prepare  # noqa: E402
from rayfl.loop import Loop  # noqa: E402
from rayfl.runtime import LocalRuntime  # noqa: E402


def run_one(algo: str, groups: int, seed: int, args) -> dict:
    over = {"algo": algo, "dataset": args.dataset, "data_root": args.data_root, "partition": "label-groups",
            "groups": groups, "clients": args.clients, "rounds": args.rounds, "seed": seed,
            "val_frac": 0.0, "test_frac": 0.2, "optimizer": "adam", "lr": 0.01, "batch_size": args.batch_size,
            "local_epochs": 1, "eval_every": args.rounds, "model": args.model, "samples_per_client":
            args.samples_per_client}
    if algo == "federico":
        over["params"] = {"M": min(args.M, args.clients - 1), "epsilon": 0.3, "beta": 0.6}
    t0 = time.perf_counter()
    p = prepare(make_config(None, over))
    loop = Loop(p, LocalRuntime(p)).run()
    f = loop.final
    out = {"algo": algo, "groups": groups, "seed": seed, "acc_w": f["test_acc_weighted_mean"],
           "acc_mean": f["test_acc_mean"], "acc_worst": f["test_acc_worst"], "seconds": time.perf_counter() - t0}
    if algo == "federico":
        out["w_same_group"] = f.get("w_same_group_mean")
        out["cousage_same"], out["cousage_cross"] = f.get("cousage_same_mean"), f.get("cousage_cross_mean")
    return out


def fmt(vals) -> str:
    v = 100 * np.asarray(vals, dtype=float)
    return f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.1f}"


def table(rows: list[dict], algos, groups) -> str:
    head = "| method | " + " | ".join(f"{g} groups: mean acc | {g} groups: worst" for g in groups) + " |"
    lines = [head, "|---|" + "---|---|" * len(groups)]
    for a in algos:
        cells = []
        for g in groups:
            sel = [r for r in rows if r["algo"] == a and r["groups"] == g]
            cells += [fmt([r["acc_w"] for r in sel]), fmt([r["acc_worst"] for r in sel])]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sine(args) -> None:
    """Figure 1: one interval of the sine curve per client, linear models; test MSE and how banded W is."""
    rows = []
    for seed in args.seeds:
        for algo in ("local", "fedavg", "federico"):
            over = {"algo": algo, "dataset": "sine", "partition": "latent", "groups": args.clients,
                    "clients": args.clients, "rounds": args.rounds, "seed": seed, "val_frac": 0.0,
                    "test_frac": 0.2, "optimizer": "adam", "lr": 0.01, "batch_size": args.batch_size,
                    "eval_every": args.rounds}
            if algo == "federico":
                over["params"] = {"M": min(args.M, args.clients - 1), "loss_sum": args.loss_sum}
            p = prepare(make_config(None, over))
            loop = Loop(p, LocalRuntime(p)).run()
            row = {"algo": algo, "seed": seed, "mse": loop.final["test_loss_weighted_mean"]}
            if algo == "federico":
                W = loop.server.W
                dist = np.abs(np.subtract.outer(np.arange(len(W)), np.arange(len(W))))
                row["mean_dist"] = float((W * dist).sum(1).mean())  # E_w |i - j|: small when W is banded
                row["W"] = np.round(W, 2).tolist()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "W"}), flush=True)
    print("\n| method | test MSE (mean ± std over seeds) |\n|---|---|")
    for algo in ("local", "fedavg", "federico"):
        v = [r["mse"] for r in rows if r["algo"] == algo]
        print(f"| {algo} | {np.mean(v):.4f} ± {np.std(v, ddof=1) if len(v) > 1 else 0:.4f} |")
    fr = [r for r in rows if r["algo"] == "federico"]
    print(f"\nFedeRiCo E_w|i-j| = {np.mean([r['mean_dist'] for r in fr]):.2f} "
          f"(uniform W over {args.clients} clients: {np.abs(np.subtract.outer(*[np.arange(args.clients)] * 2)).mean():.2f})")
    print("W (seed %d):" % fr[0]["seed"])
    for line in fr[0]["W"]:
        print("  " + " ".join(f"{v:.2f}" for v in line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--model", default="auto")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--samples-per-client", type=int, default=0)
    ap.add_argument("--M", type=int, default=3)
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", nargs="+", default=["local", "fedavg", "fedavg-ft", "federico"])
    ap.add_argument("--sine", action="store_true", help="the Figure-1 sine toy instead of the label-group table")
    ap.add_argument("--loss-sum", action="store_true", help="FedeRiCo's posterior from Eq. 3's summed loss")
    ap.add_argument("--json", default=None, help="also write every run as JSON lines here")
    args = ap.parse_args()
    if args.sine:
        return sine(args)
    rows = []
    for g in args.groups:
        for seed in args.seeds:
            for algo in args.algos:
                r = run_one(algo, g, seed, args)
                rows.append(r)
                print(json.dumps(r), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
    print()
    print(table(rows, args.algos, args.groups))
    fr = [r for r in rows if r["algo"] == "federico"]
    for g in args.groups:
        sel = [r for r in fr if r["groups"] == g]
        print(f"FedeRiCo, {g} groups: weight on same-group owners {np.mean([r['w_same_group'] for r in sel]):.2f}, "
              f"co-usage same/cross group {np.mean([r['cousage_same'] for r in sel]):.3f} / "
              f"{np.mean([r['cousage_cross'] for r in sel]):.3f}")


if __name__ == "__main__":
    main()
