"""RayRuntime: the clients live in ClientActors; one actor call per host per step, gathered at once."""

from __future__ import annotations

import ray

from rayfl.actors.client import ClientActor
from rayfl.actors.handles import resolve
from rayfl.actors.resources import ActorResources
from rayfl.runtime import assign_hosts, gather, group_by_host


class RayRuntime:
    def __init__(self, prepared, x_ref, y_ref, resources: ActorResources, n_actors: int, scheduling=None):
        """``scheduling(i)`` gives extra ``.options`` for actor i (a Tune trial's placement-group bundle)."""
        cfg, fed = prepared.cfg, prepared.federation
        blocks = assign_hosts(cfg.clients, n_actors)
        self.host_of = {c: h for h, block in enumerate(blocks) for c in block}
        initial_ref = ray.put(prepared.initial)
        self.resources = resources
        self.actors = [
            ClientActor.options(**resources.options(), **(scheduling(h) if scheduling else {})).remote(
                cfg, prepared.model_spec, prepared.info.task, x_ref, y_ref,
                {c: fed.clients[c] for c in block}, initial_ref, fed.holdout)
            for h, block in enumerate(blocks)
        ]

    def call(self, step, messages, reduce=None):
        batches = group_by_host(messages, self.host_of)
        refs = [self.actors[h].run.remote(step, items, reduce) for h, items in batches.items()]
        return gather(batches, ray.get(refs), reduce)

    def put(self, obj):
        return ray.put(obj)

    def get(self, handles):
        return resolve(list(handles))

    def client_states(self):
        return {cid: blob for part in ray.get([a.state.remote() for a in self.actors]) for cid, blob in part.items()}

    def load_client_states(self, states):
        ray.get([a.load_state.remote({c: s for c, s in states.items() if self.host_of[c] == h})
                 for h, a in enumerate(self.actors)])

    def client_vectors(self):
        return {cid: v for part in ray.get([a.vectors.remote() for a in self.actors]) for cid, v in part.items()}

    def placement(self):
        infos = ray.get([a.info.remote() for a in self.actors])
        return [{"actor": h, "num_cpus": self.resources.num_cpus, "num_gpus": self.resources.num_gpus, **info}
                for h, info in enumerate(infos)]

    def shutdown(self):
        for a in self.actors:
            ray.kill(a)
        self.actors = []
