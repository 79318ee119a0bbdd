"""Where the test suite's time goes: each named test file run on its own (pytest, one test after another, as
`make test` runs the Ray and subprocess layers), its wall time and the sum of its set-up, call and teardown
phases as pytest's ``--durations=0`` reports them, and its slowest items.

    .venv/bin/python benchmarks/suite_durations.py tests/system/test_cli.py tests/system/test_docs.py
    .venv/bin/python benchmarks/suite_durations.py --top 5 tests/integration/*.py

A module fixture's cost shows as the set-up of the first test that uses it. The figures depend on what else
the machine runs: compare files measured in one sitting, under the same load, never across sittings.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import defaultdict

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")


def measure(path: str, top: int, extra: list[str]) -> dict:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
                           "--durations-min=0", *extra, path], capture_output=True, text=True)
    wall = time.monotonic() - t0
    phases, items = defaultdict(float), []
    for line in done.stdout.splitlines():
        if m := LINE.match(line):
            seconds, phase, node = float(m.group(1)), m.group(2), m.group(3)
            phases[phase] += seconds
            items.append((seconds, phase, node.split("::", 1)[-1]))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    return {"file": path, "wall": wall, "rc": done.returncode, "summary": summary, "phases": dict(phases),
            "top": sorted(items, reverse=True)[:top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=3, help="slowest items shown per file")
    ap.add_argument("-k", help="pytest -k expression, passed on")
    args = ap.parse_args(argv)
    extra = ["-k", args.k] if args.k else []
    print("| file | wall (s) | set-up (s) | call (s) | teardown (s) | outcome |")
    print("|---|---:|---:|---:|---:|---|")
    results = []
    for path in args.files:
        r = measure(path, args.top, extra)
        results.append(r)
        p = r["phases"]
        print(f"| {r['file']} | {r['wall']:.0f} | {p.get('setup', 0):.0f} | {p.get('call', 0):.0f} | "
              f"{p.get('teardown', 0):.0f} | {r['summary']} |", flush=True)
    print()
    for r in results:
        print(f"{r['file']}:")
        for seconds, phase, node in r["top"]:
            print(f"  {seconds:7.1f}s {phase:8} {node}")
    return max(r["rc"] for r in results)


if __name__ == "__main__":
    sys.exit(main())
