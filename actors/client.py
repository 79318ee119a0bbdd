"""ClientActor: a long-lived Ray actor hosting one or more clients on its CPU slot or GPU slice.

Its constructor only keeps its arguments: the clients are built by the first call (torch imported, data
materialized, a warm-up step), so that ``__ray_ready__`` answers as soon as Ray has placed the actor and
started its process. Whoever waits for room on the cluster (``capacity_wait``) then waits for placement
only, not for the clients' start, which a fixed bound would cut short on a loaded machine.

Every answer carries the actor's ``token``, drawn anew in each process Ray starts for it: a call that
reached a restarted actor (its clients back at their initial state) is told apart from one that reached
the actor the runtime last loaded, even when no call failed in between.
"""

from __future__ import annotations

import uuid

import ray


@ray.remote
class ClientActor:
    def __init__(self, sealed, x, y, initial):
        # sealed (rayfl.plugins.Sealed): (cfg, model_spec, task, client_data, holdout, plugins), pickled apart so
        # that a plugin's module this node lacks is one line from the first call, not an actor that dies while
        # Ray reads its arguments and is restarted to die again. plugins: the run's registrations from outside
        # the package (rayfl.plugins.Plugins), registered in this process as they are read
        self.token = uuid.uuid4().hex
        self._args = (sealed, x, y, initial)
        self._host = None

    def _built(self):
        """The clients' host, built on the first call."""
        if self._host is None:
            import torch

            from rayfl.actors.handles import Batcher, resolve
            from rayfl.algorithms import get_algorithm
            from rayfl.host import ClientHost

            sealed, x, y, initial = self._args
            cfg, model_spec, task, client_data, holdout, _plugins = sealed.open()  # UserError: a module missing
            # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU(s); "cuda" is then the right one.
            self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
            self.batcher = Batcher()
            device = "cuda" if self.gpu_ids and torch.cuda.is_available() else "cpu"
            self._host = ClientHost(cfg, get_algorithm(cfg.algo), model_spec, task, x, y, client_data, initial,
                                    device=device, share=self.batcher.share, resolve=resolve, holdout=holdout)
            self.batcher.flush()
            self._args = None
        return self._host

    def run(self, step: str, packed: tuple, reduce=None) -> tuple[str, tuple]:
        from rayfl.batch import unpack

        out = self._built().run(step, unpack(packed), reduce)
        self.batcher.flush()  # one object for every vector this call's clients shared
        return self.token, out

    def state(self) -> tuple[str, dict]:
        return self.token, self._built().state()

    def save(self, full: bool) -> tuple[str, dict]:
        return self.token, self._built().save(full)

    def load_state(self, *states: dict) -> str:
        self._built().load_state(*states)
        return self.token

    def vectors(self) -> tuple[str, dict]:
        return self.token, self._built().vectors()

    def info(self) -> dict:
        host = self._built()
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpu_ids": self.gpu_ids, "token": self.token, **host.info()}
