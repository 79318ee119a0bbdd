"""Probe: is training the clients of one actor together as one batched model faster than the per-client
loop on this machine? 5 MLP 784-200-10 clients x 600 samples, batch 32, one epoch, one torch thread:
the flat-SGD loop rayfl uses against stacked weights trained with ``baddbmm`` and autograd. Three
interleaved pairs; prints the seconds of each. (Result on the 2-core VM: the batched version was 1.3x
slower, so rayfl keeps the loop; see benchmarks/README.md.)

    .venv/bin/python benchmarks/probe_batched.py
    .venv/bin/python benchmarks/probe_batched.py --clients 50 --samples 5   # one actor's share at 1,000 clients
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rayfl.training import FlatSGD, flatten, train_epochs  # noqa: E402

ap = argparse.ArgumentParser(description="batched training of K clients against the per-client loop")
ap.add_argument("--clients", type=int, default=5)
ap.add_argument("--samples", type=int, default=600)
args = ap.parse_args()
K, N, B, LR = args.clients, args.samples, 32, 0.05
torch.set_num_threads(1)
xs = [torch.randn(N, 784) for _ in range(K)]
ys = [torch.randint(0, 10, (N,)) for _ in range(K)]


def loop() -> None:
    model = flatten(nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 10)))
    for k in range(K):
        train_epochs(model, xs[k], ys[k], 1, B, FlatSGD(model, LR), F.cross_entropy, torch.Generator().manual_seed(k))


def batched() -> None:
    params = [torch.randn(K, 784, 200, requires_grad=True), torch.zeros(K, 1, 200, requires_grad=True),
              torch.randn(K, 200, 10, requires_grad=True), torch.zeros(K, 1, 10, requires_grad=True)]
    w1, b1, w2, b2 = params
    x, y = torch.stack(xs), torch.stack(ys)
    orders = torch.stack([torch.randperm(N, generator=torch.Generator().manual_seed(k)) for k in range(K)])
    for s in range(0, N, B):
        idx = orders[:, s:s + B]
        xb = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, 784))
        out = torch.baddbmm(b2, torch.relu(torch.baddbmm(b1, xb, w1)), w2)
        loss = F.cross_entropy(out.reshape(-1, 10), torch.gather(y, 1, idx).reshape(-1), reduction="sum") / idx.shape[1]
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(LR * g)


for f in (loop, batched) * 3:
    t = time.perf_counter()
    f()
    print(f"{f.__name__:8s} {time.perf_counter() - t:.4f} s", flush=True)
