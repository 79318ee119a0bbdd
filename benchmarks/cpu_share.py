"""Where a 1,000-client round's CPU goes: every process's CPU time per round (the client actors, the driver
actor, Ray's own processes), against the round's wall time. A round can be no shorter than the CPU it needs
divided by the cores; this says whether an engine change can still shorten it by filling idle time or only
by needing less CPU.

The workload of ``bench_scale.py --clients 1000`` (FedAvg, real MNIST, 10 images a client, participation 0.1,
MLP 784-200-10), through rayfl's launch path with the default placement, without MLflow. CPU is read from
every process on the machine at the 10th reported round and 5 rounds before the last (psutil: user + system
time), so start-up and shut-down are left out; run it with nothing else busy.

    .venv/bin/python benchmarks/cpu_share.py --rounds 80
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import MNIST, workload  # noqa: E402


def cpu_by_process() -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline())[:50] or p.name(), t.user + t.system)
        except psutil.Error:  # gone, or not ours to read
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=80)
    args = ap.parse_args(argv)
    if args.rounds < 20:
        raise SystemExit("cpu_share: error: --rounds={}: at least 20".format(args.rounds))
    if not os.path.isdir(MNIST):
        raise SystemExit(f"cpu_share: error: {MNIST}: the MNIST test set is needed")
    from rayfl.actors.launch import launch
    from rayfl.session import init_ray, shutdown_ray
    from rayfl.config import make_config
    from rayfl.experiment import prepare

    prepared = prepare(make_config(None, workload(1000, MNIST, args.rounds)))
    first, last = 10, args.rounds - 5
    stamps, marks = [], {}

    def on_round(event):
        stamps.append(event["time"])
        if len(stamps) in (first, last):
            marks[len(stamps)] = (time.time(), cpu_by_process())

    init_ray(None)
    try:
        launch(prepared, None, on_round=on_round)
    finally:
        shutdown_ray()
    (t_a, cpu_a), (t_b, cpu_b) = marks[first], marks[last]
    n = last - first
    total = 0.0
    for pid, (name, t) in sorted(cpu_b.items()):
        per_round = (t - cpu_a.get(pid, (name, 0.0))[1]) / n * 1e3
        total += per_round
        if per_round >= 0.3:
            print(f"  {per_round:6.1f} ms CPU a round  {name}")
    wall = (t_b - t_a) / n * 1e3
    steady = statistics.median(e - s for s, e in zip(stamps[first:last], stamps[first + 1:last + 1])) * 1e3
    print(f"all processes: {total:.1f} ms CPU a round over {wall:.1f} ms of wall time ({total / wall:.2f} cores "
          f"of {os.cpu_count()}); steady round (median) {steady:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
