"""rayfl against the fastest FL simulator (pfl-research 0.6) and raw Ray actors on the same FedAvg work,
interleaved in one sitting. It is how the engine's speed is judged.

Workloads (benchmarks/peers/workload.py): random 28x28 inputs, K clients x N samples (60% train, 20%
validation, 20% test), batch 32, SGD lr 0.05, one local epoch; every round trains every client, then
evaluates every client on its validation and test samples.

    cnn10   LeNet-5 (61,706 parameters), 10 clients x 1000 samples
    mlp10   MLP 784-200-10 (159,010 parameters), 10 clients x 1000 samples
    mlp100  MLP 784-200-10, 100 clients x 100 samples

Each system runs in its own fresh process tree: rayfl through its public path with its default (automatic)
placement and MLflow tracking on; pfl with one torchrun process per core; raw Ray with one actor per core.
Printed: steady seconds per round (median of rounds 2..end; the median over repetitions), the ratio to pfl,
and peak memory (the summed USS of the whole process tree, sampled every 0.2 s).

    .venv/bin/python benchmarks/bench_peers.py                                    # all, 3 repetitions
    .venv/bin/python benchmarks/bench_peers.py --workload mlp100 --systems rayfl,pfl --reps 1

pfl is a benchmark extra (``pip install -e '.[bench]'``), never a runtime dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
from workload import WORKLOADS, steady, write_idx  # noqa: E402


class PeakMemory:
    """Peak of the summed USS of a process and all its descendants, sampled once a second. Reading USS walks
    a process's page tables under its memory-map lock; every 0.2 s that doubled the CPU the rayfl driver's
    MLflow thread measured (8.3-9.5 against 4.3-4.8 ms a round, 1,000 clients) and slowed the round about
    4%, while the peak read once a second is the same (1.78-1.80 GiB against 1.79-1.82)."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.root, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                procs = []
            for p in procs:
                try:
                    total += p.memory_full_info().uss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


SYSTEMS = ("rayfl", "pfl", "ray")


def command(system: str, workload: str, data_root: str, rounds: int, args) -> list[str]:
    py = sys.executable
    common = ["--workload", workload, "--data-root", data_root, "--rounds", str(rounds)]
    if system == "rayfl":
        return [py, os.path.join(HERE, "peers", "run_rayfl.py"), *common, *sum((["--set", s] for s in args.set), [])]
    if system == "pfl":
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={os.cpu_count()}",
                os.path.join(HERE, "peers", "run_pfl.py"), *common]
    if system == "ray":
        return [py, os.path.join(HERE, "peers", "run_ray.py"), *common]
    raise SystemExit(f"unknown system {system!r}")


class RunFailed(Exception):
    def __init__(self, returncode: int, output: str):
        super().__init__(f"exit {returncode}")
        self.output = output


def run_retried(system: str, workload: str, data_root: str, rounds: int, args) -> dict:
    """One run; a run that fails is said so (its whole output kept in a file) and run once more, so that one
    crash does not end a sitting (pfl's torchrun ranks have died of SIGABRT here now and then)."""
    for attempt in (1, 2):
        try:
            return run_one(system, workload, data_root, rounds, args)
        except RunFailed as e:
            with tempfile.NamedTemporaryFile("w", prefix=f"{system}-{workload}-", suffix=".log", delete=False) as f:
                f.write(e.output)
            tail = "\n".join("  " + ln for ln in e.output.splitlines()[-6:])
            print(f"{system} on {workload} failed ({e}; output in {f.name}):\n{tail}", flush=True)
            if attempt == 2:
                raise SystemExit(f"{system} on {workload} failed twice")
            print(f"{system} on {workload}: run again", flush=True)


def run_one(system: str, workload: str, data_root: str, rounds: int, args) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen(command(system, workload, data_root, rounds, args), cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with PeakMemory(proc.pid) as mem:
            out, _ = proc.communicate(timeout=args.timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RunFailed(proc.returncode, out)
    result = json.loads(lines[-1][len("RESULT "):])
    return {"steady": steady(result["stamps"]), "peak": mem.peak, "startup": result.get("startup")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--systems", default="rayfl,pfl,ray", help="comma-separated: rayfl, pfl, ray")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra rayfl config values (e.g. --set clients_per_actor=5), for experiments")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown {unknown[0]!r}; allowed: {', '.join(SYSTEMS)}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as data_root:
        write_idx(data_root, max(k * n for _, k, n in WORKLOADS.values()))
        for rep in range(args.reps):  # interleaved: every system once per repetition
            for workload in args.workload:
                for system in systems:
                    r = run_retried(system, workload, data_root, args.rounds, args)
                    results.setdefault((workload, system), []).append(r)
                    print(f"rep {rep + 1} {workload:7s} {system:6s} {r['steady']:.3f} s/round  "
                          f"peak {r['peak'] / 2**30:.2f} GiB" +
                          (f"  start-up {r['startup']:.1f} s" if r.get("startup") else ""), flush=True)
    print(f"\n{'workload':8s} {'system':7s} {'s/round':>8s} {'/ pfl':>7s} {'peak GiB':>9s}")
    ratios = {}
    for workload in args.workload:
        base = statistics.median(r["steady"] for r in results.get((workload, "pfl"), [{"steady": float("nan")}]))
        for system in systems:
            rs = results[(workload, system)]
            s = statistics.median(r["steady"] for r in rs)
            peak = max(r["peak"] for r in rs)
            ratios[(workload, system)] = s / base
            print(f"{workload:8s} {system:7s} {s:8.3f} {s / base:6.2f}x {peak / 2**30:9.2f}")
    if "rayfl" in systems and "pfl" in systems:
        print()
        for workload in args.workload:
            print(f"ratio rayfl/pfl {workload} = {ratios[(workload, 'rayfl')]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
