"""Raw Ray actors on the benchmark workload: the floor for any Ray-based simulator. Two actors (one per
core) each hold half the clients' data and one model; a round is one train call per actor returning a
weighted sum, an average in the driver, and one evaluate call per actor. No tracking, no framework."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    from workload import worker_args

    args = worker_args(**{"--actors": {"type": int, "default": os.cpu_count() or 2}})
    import ray
    from workload import BATCH, LR, federation

    clients, spec, initial = federation(args.workload, args.data_root)

    @ray.remote(num_cpus=0.95)
    class Worker:
        def __init__(self, part):
            import torch

            torch.set_num_threads(1)
            self.torch = torch
            self.data = [tuple(torch.as_tensor(a) for a in c) for c in part]
            self.model = spec.build()
            self.gen = torch.Generator().manual_seed(0)

        def train(self, vec):
            torch, F = self.torch, self.torch.nn.functional
            from rayfl.training import load_vector, to_vector

            total, n_total = None, 0
            for x, y, _, _ in self.data:
                load_vector(self.model, vec)
                opt = torch.optim.SGD(self.model.parameters(), lr=LR)
                order = torch.randperm(len(x), generator=self.gen)
                for s in range(0, len(x), BATCH):
                    idx = order[s:s + BATCH]
                    opt.zero_grad()
                    F.cross_entropy(self.model(x[idx]), y[idx]).backward()
                    opt.step()
                v = to_vector(self.model).astype(np.float64) * len(x)
                total = v if total is None else total + v
                n_total += len(x)
            return total, n_total

        def evaluate(self, vec):
            from rayfl.training import load_vector

            load_vector(self.model, vec)
            with self.torch.no_grad():
                return [float((self.model(xe).argmax(1) == ye).float().mean()) for _, _, xe, ye in self.data]

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    parts = np.array_split(np.arange(len(clients)), args.actors)
    workers = [Worker.remote([clients[i] for i in p]) for p in parts]
    vec = initial
    stamps = []
    for _ in range(args.rounds):
        ref = ray.put(vec)
        sums = ray.get([w.train.remote(ref) for w in workers])
        vec = (sum(s for s, _ in sums) / sum(n for _, n in sums)).astype(np.float32)
        ref = ray.put(vec)
        accs = [a for part in ray.get([w.evaluate.remote(ref) for w in workers]) for a in part]
        stamps.append(time.time())
    ray.shutdown()
    print("RESULT " + json.dumps({"stamps": stamps, "acc": float(np.mean(accs))}), flush=True)


if __name__ == "__main__":
    main()
