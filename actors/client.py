"""ClientActor: a long-lived Ray actor hosting one or more clients on its CPU slot or GPU slice."""

from __future__ import annotations

import ray


@ray.remote
class ClientActor:
    def __init__(self, cfg, model_spec, task, x, y, client_data: dict, initial, holdout=None):
        import torch

        from rayfl.actors.handles import Batcher, resolve
        from rayfl.algorithms import get_algorithm
        from rayfl.host import ClientHost

        # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU(s); "cuda" is then the right one.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.batcher = Batcher()
        device = "cuda" if self.gpu_ids and torch.cuda.is_available() else "cpu"
        self.host = ClientHost(cfg, get_algorithm(cfg.algo), model_spec, task, x, y, client_data, initial,
                               device=device, share=self.batcher.share, resolve=resolve, holdout=holdout)
        self.batcher.flush()

    def run(self, step: str, packed: tuple, reduce=None) -> tuple:
        from rayfl.runtime import unpack

        out = self.host.run(step, unpack(packed), reduce)
        self.batcher.flush()  # one object for every vector this call's clients shared
        return out

    def state(self) -> dict:
        return self.host.state()

    def save(self, full: bool) -> dict:
        return self.host.save(full)

    def load_state(self, *states: dict) -> None:
        self.host.load_state(*states)

    def vectors(self) -> dict:
        return self.host.vectors()

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpu_ids": self.gpu_ids, **self.host.info()}
