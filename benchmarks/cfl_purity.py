"""Does Clustered FL (Sattler et al. 2020) find the groups of ``federico-label-groups`` within the preset's 20
rounds? Its split criterion (Alg. 1: mean update norm < ε1 while the largest client's > ε2) per round, the
round of the first split, and the clusters' purity against the partition's true groups (the fraction of clients
whose cluster's most common group is their own) and their completeness (the same with clusters and groups
swapped: 1.0 when no group is cut in two).

Runs in this process (``LocalRuntime``), one seed after another, the preset's config (MNIST, label groups, 8
clients, Adam lr 0.01, no validation split) with the CFL knobs given:

    .venv/bin/python benchmarks/cfl_purity.py --data-root ../shared/datasets/mnist-t10k --seeds 0 1 2 \\
        -p eps1=0.42 -p eps2=1.6 -p min_rounds=0
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from rayfl.comparison.presets import PRESETS
    from rayfl.config import make_config
    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.metrics import cluster_purity
    from rayfl.runtime import LocalRuntime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="default: the preset's")
    ap.add_argument("-c", dest="config", action="append", default=[], metavar="KEY=VALUE",
                    help="a config value over the preset's (e.g. -c optimizer=sgd)")
    ap.add_argument("-p", dest="params", action="append", default=[], metavar="KNOB=VALUE", help="a CFL knob")
    args = ap.parse_args()
    preset = PRESETS["federico-label-groups"]
    values = {**preset.config, "algo": "cfl", "groups": args.groups, "data_root": args.data_root}
    if args.rounds:
        values["rounds"] = args.rounds
    for item in args.config:
        key, value = item.split("=", 1)
        values[key] = yaml.safe_load(value)
    params = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.params)}
    print(f"federico-label-groups, groups={args.groups}, {values.get('optimizer')} lr {values.get('lr')}, "
          f"CFL {params or 'defaults'}")
    for seed in args.seeds:
        p = prepare(make_config(None, {**values, "seed": seed, "params": params}))
        loop = Loop(p, LocalRuntime(p)).run()
        norms = " ".join(f"{h['mean_update_norm']:.2f}/{h['max_update_norm']:.2f}" for h in loop.history)
        split = next((i + 1 for i, h in enumerate(loop.history) if h["clusters"] > 1), None)
        clusters, groups = loop.server.artifacts()["cluster"], p.info.groups
        print(f"seed {seed}: first split in round {split}, {len(set(clusters))} clusters, purity "
              f"{cluster_purity(clusters, groups):.2f}, completeness {cluster_purity(groups, clusters):.2f}, test "
              f"{100 * loop.final['test_acc_mean']:.2f}; mean/max update norm by round: {norms}", flush=True)


if __name__ == "__main__":
    main()
