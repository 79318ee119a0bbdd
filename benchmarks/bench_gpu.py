"""Clients sharing one GPU: McMahan's CNN on MNIST, 15 clients, default placement. Each
client actor gets a fraction of the GPU through Ray's ``num_gpus`` and sees it through its own
``CUDA_VISIBLE_DEVICES``; this prints what each actor saw, the steady round (median of rounds 3..end), and
how busy the GPU was meanwhile (``nvidia-smi`` sampled every 100 ms), against the same rounds run in one
process on the same GPU (``LocalRuntime``, device ``cuda``).

    .venv/bin/python benchmarks/bench_gpu.py --data-root ../shared/datasets/mnist-t10k
    .venv/bin/python benchmarks/bench_gpu.py --cpu --rounds 4 --clients 3   # the script's own path, no GPU

``--cpu`` runs the same path on the CPU to check the script on a machine without a GPU; it measures no GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
from bench_scale import MNIST  # noqa: E402
from runs import run_experiment  # noqa: E402
from workload import steady  # noqa: E402


class GpuSampler:
    """``nvidia-smi`` every 100 ms in the background: (time, GPU busy %, memory used MiB) of GPU 0."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--id=0", "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                busy, mem = (float(v) for v in line.split(","))
            except ValueError:  # a header or a "[N/A]"
                continue
            self.samples.append((time.time(), busy, mem))

    def between(self, t0: float, t1: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def config(args) -> dict:
    return {"algo": "fedavg", "dataset": "mnist", "data_root": os.path.abspath(args.data_root), "partition": "iid",
            "clients": args.clients, "participation": 1.0, "model": "mcmahan-cnn", "rounds": args.rounds,
            "experiment": "bench-gpu"}


def run_mode(mode: str, args, sampler: GpuSampler | None) -> dict:
    """One mode's steady round, GPU busy % and peak GPU memory over the steady rounds, and (rayfl) placement."""
    from rayfl.config import make_config
    from rayfl.experiment import prepare

    placement: list[dict] = []

    def on_event(event):
        if event.get("event") == "start":
            placement.extend(event["placement"])

    runtime = "local" if mode == "local" else "ray"
    _, stamps = run_experiment(prepare(make_config(None, config(args))), runtime,
                               device="cpu" if args.cpu else "cuda", on_event=on_event)
    out = {"mode": mode, "steady": steady(stamps), "placement": placement}
    if sampler is not None:
        window = sampler.between(stamps[1], stamps[-1])
        out["busy"] = statistics.mean(s[1] for s in window) if window else float("nan")
        out["memory"] = max((s[2] for s in window), default=float("nan"))
        out["samples"] = len(window)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", default=MNIST, help="a folder of MNIST's IDX files")
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--modes", default="rayfl,local", help="rayfl (Ray actors, default placement), local "
                    "(one process), comma-separated, run in this order")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU: checks the script, measures no GPU")
    args = ap.parse_args(argv)
    if args.rounds < 4:
        raise SystemExit(f"bench_gpu: error: rounds={args.rounds}: at least 4 (rounds 3..end are the steady ones)")
    if not os.path.isdir(args.data_root):
        raise SystemExit(f"bench_gpu: error: data_root={args.data_root}: no such folder (MNIST's IDX files)")
    modes = args.modes.split(",")
    if set(modes) - {"rayfl", "local"}:
        raise SystemExit(f"bench_gpu: error: modes={args.modes}: rayfl and/or local")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
            raise SystemExit("bench_gpu: error: no GPU here (torch.cuda.is_available() is False or no "
                             "nvidia-smi); --cpu checks the script without one")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sampler = None if args.cpu else GpuSampler()
    try:
        results = [run_mode(mode, args, sampler) for mode in modes]
    finally:
        if sampler is not None:
            sampler.stop()
    for r in results:
        for a in r["placement"]:
            print(f"  actor pid {a.get('pid')}: num_gpus {a.get('num_gpus')}, num_cpus {a.get('num_cpus')}, "
                  f"CUDA_VISIBLE_DEVICES={a.get('cuda_visible_devices')}, ray gpu ids {a.get('gpu_ids')}, "
                  f"device {a.get('device')}, clients {a.get('clients')}")
    print(f"{'mode':6s} {'s/round':>8s} {'GPU busy %':>11s} {'GPU MiB':>8s}")
    for r in results:
        gpu = f"{r['busy']:11.1f} {r['memory']:8.0f}" if "busy" in r else f"{'-':>11s} {'-':>8s}"
        print(f"{r['mode']:6s} {r['steady']:8.3f} {gpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
