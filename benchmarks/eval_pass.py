"""What a sample costs in an evaluation forward pass, by pass size, for rayfl's models on this CPU (one
thread): why ``rayfl.training.pass_size`` bounds a pass by its largest activation rather than by a count.

Prints microseconds per sample (the best of 4 passes) for passes of 32 to 4,096 random samples, and the
pass size rayfl picks for each model. Not a test: it depends on the machine's caches.

    .venv/bin/python benchmarks/eval_pass.py
"""

from __future__ import annotations

import time

import torch

from rayfl.models import build_model
from rayfl.training import largest_activation, pass_size

SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
MODELS = (("mlp-784-200", (1, 28, 28)), ("lenet5", (1, 28, 28)), ("lenet5", (3, 32, 32)),
          ("tf-cnn", (1, 28, 28)), ("mcmahan-cnn", (1, 28, 28)))


def best_seconds(fn, repeats: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':12s} {'input':11s} {'largest':>8s} {'pass':>5s}  " + " ".join(f"{b:>6d}" for b in SIZES)
          + "   (us a sample, by pass size)")
    for name, shape in MODELS:
        model = build_model(name, shape, 10).eval()
        row = []
        with torch.no_grad():
            for b in SIZES:
                x = torch.randn(b, *shape)
                row.append(1e6 * best_seconds(lambda: model(x)) / b)
        probe = torch.zeros(1, *shape)
        print(f"{name:12s} {str(shape):11s} {largest_activation(model, probe):8d} {pass_size(model, probe, 4096):5d}  "
              + " ".join(f"{v:6.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
