"""Algorithm overhead on the papers' own settings: FedFomo on ``fedfomo-pathological`` and FedeRiCo on
``federico-label-groups`` (``rayfl compare`` presets: MNIST's test set, each paper's partition, training and
knobs), each against FedAvg on the same federation. ``bench_peers.py --set algo=...`` measures the overhead
on random inputs, where nothing concentrates FedeRiCo's weights; here its mixtures shrink as the paper says
they do, and the log says by how much (``mixture_members_mean``: models in a client's prediction).

Every run goes through rayfl's public path (default placement, MLflow on, into a temporary store), and the
same experiment again in one process (``LocalRuntime``, as ``rayfl compare --local`` runs it): the ratio
there is the algorithm's arithmetic against FedAvg's, the ratio on Ray adds what the engine costs each. Runs
interleaved; steady round = median of the round walls from round 3 on, the median over repetitions.

    .venv/bin/python benchmarks/overhead_presets.py --data-root ../shared/datasets/mnist-t10k --reps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
from bench_scale import MNIST  # noqa: E402
from runs import run_experiment  # noqa: E402
from workload import steady  # noqa: E402

# (preset, algorithm, its knobs beyond the preset's, the row's name)
ROWS = [("fedfomo-pathological", "fedavg", {}, "FedAvg"),
        ("fedfomo-pathological", "fedfomo", {}, "FedFomo (M = 5)"),
        ("federico-label-groups", "fedavg", {}, "FedAvg"),
        ("federico-label-groups", "federico", {}, "FedeRiCo (default local_steps)"),
        ("federico-label-groups", "federico", {"local_steps": 1}, "FedeRiCo, local_steps = 1")]


def one_run(preset: str, algo: str, params: dict, data_root: str, rounds: int | None, runtime: str) -> dict:
    """One experiment of ``rayfl compare --preset PRESET --algos ALGO`` on Ray or (``local``) in this process:
    its steady round and last metrics."""
    from rayfl.comparison.run import build_configs
    from rayfl.experiment import prepare
    from rayfl.tracking import ensure_experiment

    flags = {"data_root": os.path.abspath(data_root), **({"rounds": rounds} if rounds else {})}
    (cfg,) = build_configs([algo], [0], preset, params=params, **flags)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        tracking = {"tracking_uri": uri, "experiment_id": ensure_experiment(uri, "overhead"), "run_name": algo}
        out, stamps = run_experiment(prepare(cfg), runtime, tracking)
    return {"steady": steady(stamps), "last": out["history"][-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", default=MNIST, help="a folder of MNIST's IDX files")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every run (default: the preset's)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.data_root):
        raise SystemExit(f"overhead_presets: error: data_root={args.data_root}: no such folder")
    if args.reps < 1 or (args.rounds is not None and args.rounds < 4):
        raise SystemExit("overhead_presets: error: --reps >= 1 and --rounds >= 4")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    got: dict[tuple, list[dict]] = {}
    for rep in range(args.reps):
        for i, (preset, algo, params, name) in enumerate(ROWS):
            for runtime in ("ray", "local"):
                r = one_run(preset, algo, params, args.data_root, args.rounds, runtime)
                got.setdefault((i, runtime), []).append(r)
                print(f"rep {rep + 1} {preset} {name} {runtime}: {r['steady']:.3f} s/round", flush=True)
    print("\n| preset | algorithm | Ray: s/round (repetitions) | x FedAvg | one process: s/round | x FedAvg "
          "| mixture_members_mean (last round) |")
    print("|---|---|---|---|---|---|---|")
    base: dict[tuple, float] = {}
    for i, (preset, algo, _, name) in enumerate(ROWS):
        cells = []
        for runtime in ("ray", "local"):
            runs = got[(i, runtime)]
            med = statistics.median(r["steady"] for r in runs)
            if algo == "fedavg":
                base[(preset, runtime)] = med
            reps = ", ".join(f"{r['steady']:.3f}" for r in runs)
            cells += [f"{med:.3f} ({reps})", f"{med / base[(preset, runtime)]:.2f}"]
        members = [r["last"].get("mixture_members_mean") for r in got[(i, "ray")]]
        shown = ", ".join(f"{m:.2f}" for m in members) if members[0] is not None else ""
        print(f"| {preset} | {name} | {' | '.join(cells)} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
