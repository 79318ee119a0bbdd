"""RayRuntime: the clients live in ClientActors; one actor call per host per step, gathered at once.

Client actors are restartable (Ray re-creates a dead one with the same arguments): a call that meets a
dead actor, or an object it owned, raises :class:`~rayfl.runtime.ClientsLost`, and the loop restores every
client from its last snapshot (:meth:`save_clients`) and replays the rounds since.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import ray

from rayfl.actors.client import ClientActor
from rayfl.actors.handles import resolve
from rayfl.actors.resources import ActorResources
from rayfl.runtime import ClientsLost, Pending, SaveChain, assign_hosts, gather, group_by_host, pack


def start_client_actors(prepared, x_ref, y_ref, resources: ActorResources, n_actors: int,
                        actor_options: list[dict] | None = None) -> tuple[list, list]:
    """Ask Ray for the client actors of a run, the clients spread evenly (:func:`assign_hosts`); returns at
    once with the handles and the refs of their constructor arguments, which the caller keeps for as long as
    the actors may restart (Ray re-creates a dead actor from them, but does not keep them itself).
    ``actor_options[i]``: extra ``.options`` for actor i (a Tune trial's placement-group bundle)."""
    cfg, fed = prepared.cfg, prepared.federation
    initial_ref = ray.put(prepared.initial)
    blocks = [ray.put({c: fed.clients[c] for c in block}) for block in assign_hosts(cfg.clients, n_actors)]
    actors = [ClientActor.options(**resources.options(), max_restarts=cfg.max_restarts,
                                  **(actor_options[h] if actor_options else {})).remote(
                  cfg, prepared.model_spec, prepared.info.task, x_ref, y_ref, block, initial_ref, fed.holdout)
              for h, block in enumerate(blocks)]
    return actors, [x_ref, y_ref, initial_ref, *blocks]


class RayRuntime:
    pipelined = True  # the clients run the next round's first call while the driver reports a round

    def __init__(self, prepared, actors: list, resources: ActorResources):
        """Over client actors from :func:`start_client_actors` (for the same ``prepared``)."""
        blocks = assign_hosts(prepared.cfg.clients, len(actors))
        self.host_of = {c: h for h, block in enumerate(blocks) for c in block}
        self.resources = resources
        self.actors = list(actors)
        self.saves = SaveChain()

    def call(self, step, messages, reduce=None):
        return self.submit(step, messages, reduce).result()

    def submit(self, step, messages, reduce=None):
        batches = group_by_host(messages, self.host_of)
        refs = [self.actors[h].run.remote(step, pack(items), reduce) for h, items in batches.items()]

        def wait():
            with clients_lost():
                results = ray.get(refs)
            return gather(batches, results, reduce)

        return Pending(wait)

    def put(self, obj):
        return ray.put(obj)

    def get(self, handles):
        with clients_lost():  # a handle whose owner (a client actor) died
            return resolve(list(handles))

    def client_states(self):
        with clients_lost():
            parts = ray.get([a.state.remote() for a in self.actors])
        return {cid: blob for part in parts for cid, blob in part.items()}

    def load_client_states(self, states):
        with clients_lost():
            ray.get([a.load_state.remote({c: s for c, s in states.items() if self.host_of[c] == h})
                     for h, a in enumerate(self.actors)])

    def save_clients(self):
        """One call per actor, not waited for: the results are owned by this process, so they outlive an actor
        that dies afterwards (they stay in the object store of its node)."""
        full = self.saves.next_is_full()
        return self.saves.add([a.save.remote(full) for a in self.actors], full)

    def restore_clients(self, saved):
        with clients_lost():  # a restarted actor that died again, or a snapshot that died with its actor
            self.await_actors()
            ray.get([a.load_state.remote(*SaveChain.of_host(saved, h)) for h, a in enumerate(self.actors)])
        self.saves.reset(saved)

    def await_actors(self, timeout_s: float = 300.0) -> None:
        """Wait while Ray restarts dead actors (a call meanwhile fails with ActorUnavailableError)."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.actors)
        while pending:
            ready = []
            for a in pending:
                try:
                    ray.get(a.info.remote())
                    ready.append(a)
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
            pending = [a for a in pending if a not in ready]
            if pending:
                time.sleep(0.2)

    def client_vectors(self):
        with clients_lost():
            parts = ray.get([a.vectors.remote() for a in self.actors])
        return {cid: v for part in parts for cid, v in part.items()}

    def placement(self):
        infos = ray.get([a.info.remote() for a in self.actors])
        return [{"actor": h, "num_cpus": self.resources.num_cpus, "num_gpus": self.resources.num_gpus, **info}
                for h, info in enumerate(infos)]

    def shutdown(self):
        for a in self.actors:
            ray.kill(a)
        self.actors = []


LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


@contextmanager
def clients_lost():
    """Ray's errors for a dead client actor (or an object it owned, read by the driver or another actor)
    as ClientsLost; every other error passes unchanged."""
    try:
        yield
    except ray.exceptions.RayError as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
        if not isinstance(cause, LOST) and not isinstance(e, LOST):
            raise
        first = (str(cause).strip().splitlines() or [""])[0]
        raise ClientsLost(f"{type(cause).__name__}: {first}") from e
