"""The benchmark workload every system runs: the same random 28x28 data, model, split and training settings.

A workload is K clients x N samples; each client keeps 60% for training, 20% validation, 20% test (rayfl's
default split), trains one epoch of minibatch SGD (batch 32, lr 0.05) from the global model, and every round
evaluates every client on its validation and test samples. The data is written as IDX files, so that rayfl
reads it through its public path (``--dataset mnist --data-root DIR``) and the peers read the same arrays.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

WORKLOADS = {  # name: (model, clients, samples per client)
    "cnn10": ("lenet5", 10, 1000),
    "mlp10": ("mlp-784-200", 10, 1000),
    "mlp100": ("mlp-784-200", 100, 100),
}
LR, BATCH, EPOCHS = 0.05, 32, 1


def write_idx(directory: str, n: int, seed: int = 0) -> None:
    """n random 28x28 uint8 images and labels 0-9, as MNIST's t10k IDX files."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    with gzip.open(os.path.join(directory, "t10k-images-idx3-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
    with gzip.open(os.path.join(directory, "t10k-labels-idx1-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">II", 2049, n) + labels.tobytes())


def config_values(workload: str, data_root: str, rounds: int, tracking_uri: str) -> dict:
    model, clients, samples = WORKLOADS[workload]
    return {"algo": "fedavg", "dataset": "mnist", "data_root": data_root, "partition": "iid", "clients": clients,
            "samples_per_client": samples, "model": model, "rounds": rounds, "lr": LR, "batch_size": BATCH,
            "local_epochs": EPOCHS, "tracking_uri": tracking_uri, "experiment": "bench-peers", "seed": 0}


def federation(workload: str, data_root: str):
    """Per-client (train x, train y, eval x, eval y) arrays, from rayfl's own loader and partition, so every
    system trains on exactly the same samples (eval = validation + test)."""
    from rayfl.config import make_config
    from rayfl.experiment import prepare

    p = prepare(make_config(None, config_values(workload, data_root, 1, "sqlite:///:memory:")))
    x, y = p.dataset.x, p.dataset.y
    out = []
    for c in p.federation.clients:
        ev = np.concatenate([c.val, c.test])
        out.append((x[c.train], y[c.train], x[ev], y[ev]))
    return out, p.model_spec, p.initial


def steady(times: list[float]) -> float:
    """Median round time over rounds 2..end (the first round pays lazy start-up work everywhere)."""
    gaps = np.diff(np.asarray(times))[1:]
    return float(np.median(gaps)) if len(gaps) else float("nan")


def worker_args(**extra):
    """The command line every system's runner takes: --workload, --data-root, --rounds (and ``extra``:
    flag -> argparse keywords)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=list(WORKLOADS))
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    for flag, kwargs in extra.items():
        ap.add_argument(flag, **kwargs)
    return ap.parse_args()
