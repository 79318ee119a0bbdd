"""Time to the first round: where the seconds before round 1 go, for the digits demo (`rayfl run`'s defaults).

Each phase is timed from the submitting process, by the events the Python API reports as they happen:

    imports      python starts and imports rayfl (a `python -c "import rayfl"` of its own)
    prepare      the call until its plan: config, data (digits), partition, the run directory
    ray          starting the private local Ray instance
    actors       the driver and the client actors up, each with its clients built
    first round  setup and round 1, as reported to the submitter

then the same run again in the same process, as a notebook's second ``rayfl.run`` does: Ray kept up by the first
call, and its client actors and driver reused (the same placement shape), from the call to its first round and
to its end (``reused`` says whether the second run's actors were the first run's processes).

    python benchmarks/bench_startup.py             # 3 repetitions, each in a fresh process
    python benchmarks/bench_startup.py --reps 5 --rounds 2

Prints a markdown table (median and range over the repetitions); paste it into benchmarks/README.md with the
command. Run it on a quiet machine: nothing else may be running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("imports", "prepare", "ray", "actors", "first round", "to round 1", "second run: to round 1",
          "second run: whole call")

CHILD = r"""
import json, sys, time
t_start = float(sys.argv[1])
t0 = time.monotonic()
import rayfl
marks = {"imported": time.monotonic()}

def seen(event, key):
    def on(e):
        if e["event"] == "plan":
            marks.setdefault(key + "plan", time.monotonic())
        elif e["event"] == "cluster" and e.get("state") == "ready":
            marks.setdefault(key + "ray", time.monotonic())
        elif e["event"] == "actors" and e.get("ready") == e.get("total") and e.get("total"):
            marks.setdefault(key + "actors", time.monotonic())
        elif e["event"] == "round":
            marks.setdefault(key + "round", time.monotonic())
        elif e["event"] == "start":
            marks.setdefault(key + "pids", sorted(a["pid"] for a in e["placement"]) + [e["driver_pid"]])
    return on

common = dict(rounds=int(sys.argv[2]), tracking_uri=sys.argv[3], out_dir=sys.argv[4])
marks["call"] = time.monotonic()
rayfl.run(progress=seen(None, ""), **common)
marks["call2"] = time.monotonic()
rayfl.run(progress=seen(None, "2"), **common)
marks["end2"] = time.monotonic()
print(json.dumps({"t0": t0, "launched": t_start, **marks}))
"""


def one(rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        launched = time.monotonic()
        out = subprocess.run([sys.executable, "-c", CHILD, str(launched), str(rounds), f"sqlite:///{d}/m.db",
                              os.path.join(d, "runs")], capture_output=True, text=True, cwd=d)
        if out.returncode != 0:
            sys.exit(f"the run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
    ready = m.get("actors", m["ray"])  # an event not seen (actors reported before Ray's line): no phase
    return {"imports": m["imported"] - m["launched"], "prepare": m["plan"] - m["call"], "ray": m["ray"] - m["plan"],
            "actors": ready - m["ray"], "first round": m["round"] - ready, "to round 1": m["round"] - m["launched"],
            "second run: to round 1": m["2round"] - m["call2"], "second run: whole call": m["end2"] - m["call2"],
            "reused": m.get("pids") == m.get("2pids")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    runs = []
    for i in range(args.reps):
        runs.append(one(args.rounds))
        print(f"rep {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in runs[-1].items() if k in PHASES)
              + f"; actors reused: {runs[-1]['reused']}", file=sys.stderr)
    print(f"\n`python benchmarks/bench_startup.py --reps {args.reps} --rounds {args.rounds}` "
          f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)\n")
    print("| phase | median s | min s | max s |\n|---|---:|---:|---:|")
    for phase in PHASES:
        values = [r[phase] for r in runs]
        print(f"| {phase} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    print(f"\nsecond run's actors reused in {sum(r['reused'] for r in runs)} of {len(runs)} repetitions")


if __name__ == "__main__":
    main()
