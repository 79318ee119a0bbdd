"""Cost of a PersFL λ x T sweep (`rayfl tune`, one trial per grid point, stages shared through the stage cache)
against one PersFL run that searches the same grid per client inside its stage 2 (`rayfl run`).

The issue's target: the default 35-point grid (tune_spaces/persfl.yaml, digits) costs at most 1.5x one run.
Each command is its own process with its own private Ray instance, run one after the other.

    python benchmarks/bench_tune_reuse.py                          # the default space: 5 x 7 on digits
    python benchmarks/bench_tune_reuse.py --lam 0 0.5 --T 1 5      # a 2 x 2 grid (quick)
    python benchmarks/bench_tune_reuse.py --no-reuse               # also the sweep with --no-stage-reuse

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
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lam", type=float, nargs="+", help="λ grid (default: the space file's)")
    p.add_argument("--T", type=float, nargs="+", help="T grid (default: the space file's)")
    p.add_argument("--max-concurrent", type=int, default=None)
    p.add_argument("--no-reuse", action="store_true", help="also time the sweep without stage reuse")
    p.add_argument("extra", nargs="*", help="more flags for both commands, after --, e.g. -- --rounds 10")
    args = p.parse_args()
    space = yaml.safe_load(open(os.path.join(ROOT, "tune_spaces", "persfl.yaml")))
    lam, T = args.lam or space["grid"]["lam"], args.T or space["grid"]["T"]
    fixed = [f for k, v in space["fixed"].items() for f in (f"--{k.replace('_', '-')}", str(v))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        space_file = os.path.join(tmp, "space.yaml")
        with open(space_file, "w") as f:
            yaml.safe_dump({"fixed": space["fixed"], "grid": {"lam": list(lam), "T": list(T)}}, f, sort_keys=False)
        common = ["--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "--out-dir", os.path.join(tmp, "runs"), *args.extra]
        run = [sys.executable, "-m", "rayfl.cli", "run", "--algo", "persfl", *fixed, *common,
               "-p", "lam_grid=" + ",".join(map(str, lam)), "-p", "T_grid=" + ",".join(map(str, T))]
        rows.append(("one PersFL run (the grid searched per client inside)", timed(run)))
        print(f"run: {rows[-1][1]:.1f} s", file=sys.stderr, flush=True)
        for reuse in (True, False) if args.no_reuse else (True,):
            name = "reuse" if reuse else "noreuse"
            tune = [sys.executable, "-m", "rayfl.cli", "tune", "--algo", "persfl", "--space", space_file, *common,
                    "--storage-path", os.path.join(tmp, "tune"), "--name", name, "--quiet"]
            tune += [] if reuse else ["--no-stage-reuse"]
            tune += ["--max-concurrent", str(args.max_concurrent)] if args.max_concurrent else []
            wall = timed(tune)
            table = pd.read_csv(os.path.join(tmp, "tune", name, "results.csv"))
            label = f"`rayfl tune`, {len(table)} trials, " + ("stage 1 shared" if reuse else "no stage reuse")
            rows.append((label, wall))
            print(f"{name}: {wall:.1f} s", file=sys.stderr, flush=True)
    one = rows[0][1]
    print(f"grid {len(lam)} x {len(T)} (λ x T)\n\n| what | wall (s) | x one run |\n|---|---|---|")
    for label, wall in rows:
        print(f"| {label} | {wall:.1f} | {wall / one:.2f} |")


if __name__ == "__main__":
    main()
