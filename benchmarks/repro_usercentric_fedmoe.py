"""Scaled-down reproductions of user-centric FL (paper 003, Table I) and FedMoE (paper 001, Table 1).

In-process (LocalRuntime, no Ray): the point is the accuracy direction, not speed. Every run reports the
final round (never the best round on test), over several seeds.

User-centric, three of the paper's settings beside Local and FedAvg (LeNet-5, SGD lr 0.1 momentum 0.9, as in
the paper): label shift (Dirichlet 0.4, k = m streams), covariate shift (4 rotation groups, k = 4), concept
shift (4 label-permutation groups, k = 4). Headline metric: worst-user test accuracy.

FedMoE, majority-class skew p beside Local, FedAvg and FedAvg-FT (Adam, 5 of the clients per round, local
epochs 3, batch 10 as in the paper; fewer rounds and a larger lr to fit the budget): local test accuracy and
accuracy on the balanced global test set for FedMoE's own FedAvg / Fine-tuned / Mixture models.

    .venv/bin/python benchmarks/repro_usercentric_fedmoe.py --dataset mnist \
        --data-root /work/shared/datasets/mnist-t10k --samples-per-client 200 --seeds 0 1 2 \
        --uc-rounds 30 --moe-rounds 30 --majority 0.5

(the recorded runs, their reading and the n_k ablation: benchmarks/results_usercentric_fedmoe.md)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop
from rayfl.runtime import LocalRuntime


class KeepStages(Callback):
    """The per-client evaluation records of the last evaluated round of each stage."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def on_round(self, loop, record):
        if record.per_client:
            self.records[record.stage] = record.per_client


def run(values: dict) -> tuple[Loop, KeepStages]:
    p = prepare(make_config(None, values))
    keep = KeepStages()
    loop = Loop(p, LocalRuntime(p), [keep]).run()
    return loop, keep


def mean_over_clients(records: dict, key: str) -> tuple[float, float]:
    vals = np.array([r[key] for r in records.values()], dtype=np.float64)
    return float(vals.mean()), float(vals.min())


def fmt(values: list[float]) -> str:
    v = 100 * np.asarray(values)
    return f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.1f}"


# --------------------------------------------------------------------------------------------- user-centric

def usercentric_settings(a) -> list[tuple[str, dict, int]]:
    common = {"dataset": a.dataset, "data_root": a.data_root, "model": "lenet5", "clients": a.uc_clients,
              "rounds": a.uc_rounds, "lr": 0.1, "momentum": 0.9, "optimizer": "sgd", "batch_size": 32,
              "local_epochs": 1, "samples_per_client": a.samples_per_client, "eval_every": a.uc_rounds}
    return [("label shift (Dirichlet 0.4), k = m", {**common, "partition": "dirichlet", "alpha": 0.4}, 0),
            ("covariate shift (4 rotation groups), k = 4", {**common, "partition": "rotation", "groups": 4}, 4),
            ("concept shift (4 label permutations), k = 4", {**common, "partition": "permutation", "groups": 4}, 4)]


def bench_usercentric(a, out: list[str]) -> None:
    nk = a.uc_sigma_batch or 32
    out += [f"## User-centric FL (paper 003), sigma batch n_k = {nk}: final-round test accuracy (%), mean ± std "
            "over seeds", "",
            "| setting | algorithm | mean acc | worst-user acc | streams ARI vs groups | silhouette best k |",
            "|---|---|---|---|---|---|"]
    for name, base, streams in usercentric_settings(a):
        for algo in a.uc_algos:
            means, worsts, ari, best_k = [], [], [], []
            for seed in a.seeds:
                t0 = time.perf_counter()
                vals = {**base, "algo": algo, "seed": seed}
                if algo == "usercentric":
                    vals["params"] = {"streams": streams, "sigma_batch": a.uc_sigma_batch}
                loop, _ = run(vals)
                means.append(loop.final["test_acc_mean"])
                worsts.append(loop.final["test_acc_worst"])
                if algo == "usercentric":
                    ari.append(loop.setup_metrics.get("streams_ari_groups", float("nan")))
                    best_k.append(loop.setup_metrics.get("silhouette_best_k", float("nan")))
                log(f"{name} | {algo} | seed {seed}: mean {means[-1]:.3f} worst {worsts[-1]:.3f} "
                    f"({time.perf_counter() - t0:.0f}s)")
            extra = (f"{np.nanmean(ari):.2f}" if ari and not np.all(np.isnan(ari)) else "n/a",
                     "/".join(str(int(k)) for k in best_k) if best_k else "")
            out.append(f"| {name} | {algo} | {fmt(means)} | {fmt(worsts)} | {extra[0] if ari else ''} | {extra[1]} |")
    out.append("")


# --------------------------------------------------------------------------------------------- FedMoE

def bench_fedmoe(a, out: list[str]) -> None:
    base = {"dataset": a.dataset, "data_root": a.data_root, "model": "lenet5", "partition": "majority",
            "majority": a.majority, "clients": a.moe_clients, "rounds": a.moe_rounds,
            "participation": 5 / a.moe_clients, "optimizer": "adam", "lr": a.moe_lr, "batch_size": 10,
            "local_epochs": 3, "samples_per_client": a.samples_per_client, "eval_every": a.moe_rounds}
    moe = {"specialist_epochs": a.moe_epochs, "gate_epochs": a.moe_epochs, "patience": a.moe_patience,
           "opt_out": a.opt_out, "mixture_loss": a.mixture_loss}
    rows: dict[str, dict[str, list]] = {}

    def add(row, key, value):
        rows.setdefault(row, {}).setdefault(key, []).append(value)

    for seed in a.seeds:
        t0 = time.perf_counter()
        local, _ = run({**base, "algo": "local", "seed": seed, "participation": 1.0})
        fedavg, _ = run({**base, "algo": "fedavg", "seed": seed})
        ft, _ = run({**base, "algo": "fedavg-ft", "seed": seed,
                     "params": {"ft_epochs": a.moe_ft_epochs, "ft_lr": a.moe_lr / 5}})
        for row, loop in (("Local (`local`)", local), ("FedAvg (`fedavg`)", fedavg), ("FedAvg-FT (`fedavg-ft`)", ft)):
            add(row, "local", loop.final["test_acc_mean"])
            add(row, "worst", loop.final["test_acc_worst"])
        loop, keep = run({**base, "algo": "fedmoe", "seed": seed, "params": moe})
        final = keep.records["mixture"]
        for row, prefix in (("FedMoE stage 1: FedAvg (selected)", "fedavg_"),
                            ("FedMoE stage 2: Fine-tuned (early stop)", "finetuned_"), ("FedMoE: Mixture", "")):
            for split, key in (("test", "local"), ("global", "global")):
                m, w = mean_over_clients(final, f"{prefix}{split}_acc")
                add(row, key, m)
                if split == "test":
                    add(row, "worst", w)
        add("FedMoE: Mixture", "gate", mean_over_clients(final, "gate_mean")[0])
        log(f"fedmoe seed {seed}: " + ", ".join(f"{r}: {v['local'][-1]:.3f}" for r, v in rows.items())
            + f" ({time.perf_counter() - t0:.0f}s)")
    out += [f"## FedMoE (paper 001): majority-class p = {a.majority}, opt-out q = {a.opt_out}, "
            f"mixture loss = {a.mixture_loss}; final test accuracy (%), mean ± std over seeds", "",
            "| method | local test acc | worst client (local) | balanced global test acc |", "|---|---|---|---|"]
    for row, v in rows.items():
        out.append(f"| {row} | {fmt(v['local'])} | {fmt(v['worst'])} | {fmt(v['global']) if 'global' in v else 'n/a'} |")
    gate = rows["FedMoE: Mixture"]["gate"]
    out += ["", f"Mean gate value h on the local test sets (weight of the specialist): {np.mean(gate):.2f}", ""]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--samples-per-client", type=int, default=0)
    ap.add_argument("--only", choices=("usercentric", "fedmoe"), default=None)
    ap.add_argument("--uc-clients", type=int, default=20)
    ap.add_argument("--uc-rounds", type=int, default=30)
    ap.add_argument("--uc-algos", nargs="+", default=["local", "fedavg", "usercentric"])
    ap.add_argument("--uc-sigma-batch", type=int, default=0, help="n_k of eq. (7); 0: the batch size (32)")
    ap.add_argument("--moe-clients", type=int, default=20)
    ap.add_argument("--moe-rounds", type=int, default=40)
    ap.add_argument("--moe-lr", type=float, default=1e-3)
    ap.add_argument("--moe-epochs", type=int, default=100)
    ap.add_argument("--moe-patience", type=int, default=10)
    ap.add_argument("--moe-ft-epochs", type=int, default=10)
    ap.add_argument("--majority", type=float, default=0.8)
    ap.add_argument("--opt-out", type=float, default=0.0)
    ap.add_argument("--mixture-loss", default="paper")
    ap.add_argument("--out", default=None, help="also write the markdown tables here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = [f"dataset `{a.dataset}`, seeds {a.seeds}, in-process LocalRuntime", ""]
    if a.only in (None, "usercentric"):
        bench_usercentric(a, out)
    if a.only in (None, "fedmoe"):
        bench_fedmoe(a, out)
    out.append(f"total {time.perf_counter() - t0:.0f} s")
    text = "\n".join(out)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
