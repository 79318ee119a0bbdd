"""The actors of the last run, kept for the next run in the same process (a notebook's second ``rayfl.run``).

Starting a client actor is a process that imports torch (seconds each on a small machine); the driver actor
also imports MLflow. When the Python API started Ray itself it keeps Ray up after a run
(:mod:`rayfl.session`), and with it the run's actors: the next run whose placement has the same shape (as many
client actors, the same CPUs and GPUs each, the same ``max_restarts``) gets them, each given the new run's
arguments (``setup``) and building its clients anew, so that its results are those of fresh actors. A run of
another shape kills them and starts its own. Only a run that ended cleanly, with no client actor restarted,
leaves its actors here; the pool holds them until the next run, :func:`rayfl.shutdown`, or the end of the
process.

Kept actors hold their CPUs and GPUs: :meth:`ActorPool.held` is what a run plans with as free again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


PING_SECONDS = 5.0  # how long a kept actor may take to answer before it counts as gone


@dataclass
class KeptClients:
    """Client actors kept from a run: ``shape`` (n_actors, ActorResources, max_restarts), the refs they were
    created from (Ray re-creates a restarted actor from them, so they live as long as the actors), the node
    of each actor."""

    shape: tuple
    actors: list
    creation: list
    nodes: list = field(default_factory=list)


class ActorPool:
    """At most one run's client actors and one driver actor, alive between runs."""

    def __init__(self):
        self.clients: KeptClients | None = None
        self.driver = None
        self.driver_node: str | None = None

    def held(self) -> dict[str, dict[str, float]]:
        """The CPUs and GPUs the kept actors hold, by node id (a node not known: under ``""``)."""
        from rayfl.actors.resources import DRIVER_CPUS

        out: dict[str, dict[str, float]] = {}

        def add(node, cpus: float, gpus: float) -> None:
            have = out.setdefault(node or "", {"CPU": 0.0, "GPU": 0.0})
            have["CPU"] += cpus
            have["GPU"] += gpus

        if self.driver is not None:
            add(self.driver_node, DRIVER_CPUS, 0.0)
        if self.clients is not None:
            _, res, _ = self.clients.shape
            nodes = self.clients.nodes or [None] * len(self.clients.actors)
            for node in nodes:
                add(node, res.num_cpus, res.num_gpus)
        return out

    def take_clients(self, shape: tuple) -> KeptClients | None:
        """The kept client actors when they have this ``shape`` (they leave the pool); otherwise they are
        killed, and None."""
        kept, self.clients = self.clients, None
        if kept is None:
            return None
        if kept.shape == shape:
            return kept
        _kill(kept.actors)
        return None

    def take_driver(self):
        driver, self.driver, self.driver_node = self.driver, None, None
        return driver

    def keep(self, driver, clients: KeptClients | None, driver_node: str | None = None) -> None:
        """Hold a run's actors for the next run (anything held before is killed)."""
        self.close()
        self.driver, self.driver_node, self.clients = driver, driver_node, clients

    def prune(self, timeout: float = PING_SECONDS) -> None:
        """Every kept actor killed unless each answers within ``timeout`` seconds (one died while kept)."""
        import ray

        kept = [self.driver] if self.driver is not None else []
        kept += self.clients.actors if self.clients is not None else []
        if not kept:
            return
        pings = [a.__ray_ready__.remote() for a in kept]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout)
        try:
            if len(ready) == len(pings):
                ray.get(pings)
                return
        except ray.exceptions.RayError:
            pass
        self.close()

    def close(self) -> None:
        """Kill every kept actor."""
        kept = [self.take_driver(), *(self.clients.actors if self.clients else [])]
        self.clients = None
        _kill([a for a in kept if a is not None])


def _kill(actors: list) -> None:
    import ray

    if not ray.is_initialized():
        return
    for actor in {id(a): a for a in actors}.values():
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
