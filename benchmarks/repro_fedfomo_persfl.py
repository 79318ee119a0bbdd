"""Reproduction: local / fedavg / fedavg-ft / fedfomo / persfl on pathological non-IID (2 classes per client).

The paper's direction to check (FedFomo Table 1, PersFL Tables 2-3): FedFomo and PersFL well above FedAvg and
not below local training. Runs in-process (LocalRuntime, no Ray, no MLflow): the numbers are the shared loop's
final-round test accuracy per client, summarized as the unweighted mean and the worst client, over seeds.

    .venv/bin/python benchmarks/repro_fedfomo_persfl.py --dataset mnist \
        --data-root /work/shared/datasets/mnist-t10k --model mlp-784-100 --seeds 0 1 2

Prints a markdown table (and writes the raw per-run numbers as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime

ALGOS = ("local", "fedavg", "fedavg-ft", "fedfomo", "persfl")


def algo_params(algo: str, args) -> dict:
    if algo == "fedavg-ft":
        return {"ft_epochs": args.local_epochs}  # the same budget as PersFL's distillation per grid point
    if algo == "fedfomo":
        return {"M": args.M}
    return {}


def one_run(algo: str, seed: int, args) -> dict:
    cfg = make_config(None, {"algo": algo, "dataset": args.dataset, "data_root": args.data_root,
                             "partition": "pathological", "classes_per_client": 2, "clients": args.clients,
                             "rounds": args.rounds, "local_epochs": args.local_epochs, "lr": args.lr,
                             "batch_size": args.batch_size, "model": args.model, "val_frac": 0.2, "test_frac": 0.2,
                             "seed": seed, "eval_every": args.rounds, "params": algo_params(algo, args)})
    p = prepare(cfg)
    t0 = time.perf_counter()
    loop = Loop(p, LocalRuntime(p)).run()
    out = {"algo": algo, "seed": seed, "seconds": time.perf_counter() - t0,
           "acc_mean": loop.final["test_acc_mean"], "acc_worst": loop.final["test_acc_worst"],
           "acc_std": loop.final["test_acc_std"],
           "per_client": [loop.last_eval[c]["test_acc"] for c in sorted(loop.last_eval)]}
    arts = loop.server.artifacts()
    if algo == "persfl":
        t = arts["persfl_clients"]
        out["teacher_rounds"] = t.teacher_round.tolist()
        out["lam"], out["T"] = t.lam.tolist(), t["T"].tolist()
    if algo == "fedfomo":
        out["self_weight_mean"] = float(np.diag(arts["weights"]).mean())  # w* on the client's own model
    return out


def table(runs: list[dict]) -> str:
    lines = ["| algorithm | mean acc (%) | worst-client acc (%) | per seed: mean / worst |",
             "|---|---|---|---|"]
    for algo in ALGOS:
        rs = [r for r in runs if r["algo"] == algo]
        if not rs:
            continue
        m = 100 * np.array([r["acc_mean"] for r in rs])
        w = 100 * np.array([r["acc_worst"] for r in rs])
        per = ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(m, w))
        lines.append(f"| {algo} | {m.mean():.2f} ± {m.std(ddof=1) if len(m) > 1 else 0:.2f} | "
                     f"{w.mean():.2f} ± {w.std(ddof=1) if len(w) > 1 else 0:.2f} | {per} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--data-root", default="/work/shared/datasets/mnist-t10k")
    ap.add_argument("--model", default="mlp-784-100")
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=20)  # FedFomo: 20 rounds for 15 clients
    ap.add_argument("--local-epochs", type=int, default=5)  # FedFomo: E = 5
    ap.add_argument("--lr", type=float, default=0.01)  # FedFomo: 0.01 on MNIST
    ap.add_argument("--batch-size", type=int, default=50)  # FedFomo's code: 50
    ap.add_argument("--M", type=int, default=5)  # FedFomo: "5 clients downloaded"
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--json", default=None, help="write the raw per-run results here")
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        for algo in args.algos:
            r = one_run(algo, seed, args)
            runs.append(r)
            print(f"# {algo} seed={seed}: mean {100 * r['acc_mean']:.2f} worst {100 * r['acc_worst']:.2f} "
                  f"({r['seconds']:.0f} s)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    print(table(runs))


if __name__ == "__main__":
    main()
