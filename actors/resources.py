"""How many client actors a run gets and how many CPUs and GPUs each asks for, from the nodes' free resources.

Placement is automatic by default (``clients_per_actor: auto``): one client actor per client while the
nodes have a slot for each (a share of ``torch_threads`` CPUs on one node, within its memory), otherwise one
actor per slot with the clients spread evenly. A slot is a CPU share also when there are GPUs: the GPUs are
then divided among the actors, and only nodes with GPUs count.

Every actor lives on one node, so sizes are planned and checked node by node, never against the cluster's
totals: two 0.98-CPU actors do not fit a 2-CPU node that also holds the driver's share. The driver actor goes
wherever Ray puts it, so a plan counts it on the node where it would cost the most actors.

Fractional GPUs let several client actors share one GPU (Ray sets CUDA_VISIBLE_DEVICES for each);
an explicit ``num_cpus`` is always given, since an actor without one still reserves a whole CPU for
scheduling and the third actor on a 2-core machine would never start.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

DRIVER_CPUS = 0.05  # the driver actor mostly waits on its clients
ACTOR_MEMORY = 0.5 * 2**30  # a process that imports torch: ~470 MiB unique memory, measured (notes §5)
CPU_STEP, GPU_STEP = 0.01, 0.0001  # the grain of planned shares
EPS = 1e-9


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float

    def options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


def nodes_of(cluster) -> list[dict]:
    """A cluster description as node shapes (``{"CPU", "GPU", "memory"}`` free on each node): a list as it
    is, one dict as one node."""
    if isinstance(cluster, dict):
        return [cluster]
    return list(cluster)


def live_nodes(free: bool = True) -> list[dict]:
    """What each live node of the connected cluster has free now (Ray's view; it omits what is used up), or
    in all (``free=False``: the shape to divide among experiments that run side by side)."""
    import ray

    from rayfl.ray_compat import resources_per_node

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    per_node = resources_per_node(free)
    return [{"node_id": node, **{k: float(have.get(k, 0.0)) for k in ("CPU", "GPU", "memory")}}
            for node, have in sorted(per_node.items()) if node in alive]


def divided(nodes: list[dict], parts: int) -> list[dict]:
    """Each node's resources divided among ``parts`` experiments that run side by side."""
    return [{**n, **{k: float(n.get(k, 0.0)) / parts for k in ("CPU", "GPU", "memory")}} for n in nodes]


def _uses_gpus(cfg, nodes: list[dict]) -> bool:
    return cfg.gpus_per_actor > 0 or (cfg.gpus_per_actor < 0 and any(float(n.get("GPU", 0)) > 0 for n in nodes))


def slots(cfg, cluster) -> int:
    """Client actors the nodes have room for: on each node one per ``cpus_per_actor`` (else ``torch_threads``)
    CPUs, the driver's small share allowed for, and no more than its memory holds at ACTOR_MEMORY each; only
    nodes with GPUs count when the actors use GPUs."""
    nodes = nodes_of(cluster)
    if _uses_gpus(cfg, nodes):
        nodes = [n for n in nodes if float(n.get("GPU", 0)) > 0] or nodes
    per = cfg.cpus_per_actor or cfg.torch_threads
    total = 0
    for node in nodes:
        by_cpu = math.floor(float(node.get("CPU", 0.0)) / per + DRIVER_CPUS * 2)
        memory = float(node.get("memory", 0.0))
        total += min(by_cpu, math.floor(memory / ACTOR_MEMORY)) if memory else by_cpu
    return max(1, total)


def n_actors_for(cfg, cluster) -> int:
    from rayfl.runtime import hosts_for

    return len(hosts_for(cfg, slots(cfg, cluster)))


def local_cluster(num_cpus: int | None = None) -> dict:
    """What a private local Ray instance on this machine will offer, known before it starts: CPUs, GPUs and
    about 65% of the machine's total memory (Ray offers what is free less its object store; the total keeps
    the plan and its hints the same from run to run)."""
    import psutil

    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA is no GPU
        gpus = 0
    return {"CPU": float(num_cpus or os.cpu_count() or 1), "GPU": float(gpus),
            "memory": 0.65 * psutil.virtual_memory().total}


# --------------------------------------------------------------------------------------------------
# How many actors of a size the nodes hold
# --------------------------------------------------------------------------------------------------
def _on_node(node: dict, cpus: float, gpus: float, driver: float = 0.0, memory: bool = True) -> int:
    """Actors of ``cpus`` and ``gpus`` one node holds beside ``driver`` CPUs (-1: not even the driver)."""
    cpu = float(node.get("CPU", 0.0)) - driver
    if cpu < -EPS:
        return -1
    n = math.floor((cpu + EPS) / cpus) if cpus > 0 else 1 << 30
    if gpus > 0:
        n = min(n, math.floor((float(node.get("GPU", 0.0)) + EPS) / gpus))
    mem = float(node.get("memory", 0.0))
    if memory and mem:
        n = min(n, math.floor(mem / ACTOR_MEMORY))
    return max(0, n)


def capacity(cluster, cpus: float, gpus: float, memory: bool = True, driver: bool = True) -> int:
    """Actors of one size that the nodes hold together with the driver's share, wherever Ray puts the driver
    (on the node where it costs the most actors); 0 when no node has room for the driver. ``driver=False``:
    the driver already runs (its share is not free)."""
    nodes = nodes_of(cluster)
    alone = [_on_node(n, cpus, gpus, 0.0, memory) for n in nodes]
    if not driver:
        return sum(alone)
    beside = [_on_node(n, cpus, gpus, DRIVER_CPUS, memory) for n in nodes]
    costs = [a - b for a, b in zip(alone, beside) if b >= 0]
    return sum(alone) - max(costs) if costs else 0


def _largest(fits, top: float, step: float) -> float | None:
    """The largest multiple of ``step`` in (0, ``top``] for which ``fits`` holds (it holds for every smaller
    value once it holds for one); None when not even ``step`` fits."""
    lo, hi = 0, int(math.floor(top / step + EPS))
    if hi < 1 or not fits(step):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return round(lo * step, 6)


def plan_actor_resources(cfg, n_actors: int, cluster) -> ActorResources:
    """Per-actor CPUs and GPUs: the user's values where given, else the largest even size that ``n_actors``
    of fit on the nodes beside the driver (CPUs at most ``torch_threads``, GPUs at most one).

    ``cluster``: node shapes (:func:`live_nodes`), or one dict for one node (a trial's reservation).
    """
    nodes = nodes_of(cluster)
    if cfg.gpus_per_actor >= 0:
        gpus = cfg.gpus_per_actor
    elif any(float(n.get("GPU", 0.0)) > 0 for n in nodes):
        gpus = _largest(lambda g: sum(_on_node(n, 0.0, g, memory=False) for n in nodes) >= n_actors,
                        1.0, GPU_STEP) or GPU_STEP
    else:
        gpus = 0.0
    if cfg.cpus_per_actor > 0:
        cpus = cfg.cpus_per_actor
    else:
        cpus = _largest(lambda c: capacity(nodes, c, gpus, memory=False) >= n_actors,
                        float(cfg.torch_threads), CPU_STEP) or CPU_STEP
    return ActorResources(round(cpus, 4), round(gpus, 4))


def shapes(cluster) -> str:
    """The nodes as a user reads them: ``2 nodes with 2 CPU free, 1 with 0 CPU``."""
    def one(n: dict) -> str:
        gpu = float(n.get("GPU", 0.0))
        return f"{float(n.get('CPU', 0.0)):g} CPU" + (f" {gpu:g} GPU" if gpu else "")

    counts = Counter(one(n) for n in nodes_of(cluster))
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def check_fits(res: ActorResources, n_actors: int, cluster, n_clients: int | None = None) -> None:
    """A request the nodes cannot hold would wait forever, or end in Ray's out-of-memory killer: say so in one
    line naming the nodes' free shapes and the flag to change, before any actor starts."""
    from rayfl.config import UserError

    nodes = nodes_of(cluster)
    fit = capacity(nodes, res.num_cpus, res.num_gpus)
    if fit >= n_actors:
        return
    where = f"free on the nodes: {shapes(nodes)}"
    hint = (f"set clients_per_actor >= {-(-n_clients // fit)}" if n_clients and fit else "raise clients_per_actor")
    if capacity(nodes, res.num_cpus, res.num_gpus, memory=False) >= n_actors:
        memory = sum(float(n.get("memory", 0.0)) for n in nodes)
        raise UserError(f"{n_actors} client actors need about {n_actors * ACTOR_MEMORY / 2**30:.0f} GiB "
                        f"(0.5 GiB each with torch), the nodes offer {memory / 2**30:.0f} GiB ({where}): "
                        f"at most {fit} actors fit: {hint}, or leave it auto")
    gpu_bound = res.num_gpus > 0 and capacity(nodes, 0.0, res.num_gpus, memory=False) < n_actors
    flag, per = ("gpus_per_actor", res.num_gpus) if gpu_bound else ("cpus_per_actor", res.num_cpus)
    raise UserError(f"{flag}={per:g}: {n_actors} client actors of {res.num_cpus:g} CPU"
                    + (f" and {res.num_gpus:g} GPU" if res.num_gpus else "")
                    + f" each, beside the driver's {DRIVER_CPUS:g} CPU, do not fit ({where}; an actor cannot "
                    f"span nodes): at most {max(fit, 0)} fit; lower {flag}, {hint}, or leave both automatic")


def preflight(cfg, cluster=None) -> tuple[int, ActorResources]:
    """The placement of a run and its resource check, from node shapes; with none, from this machine as a
    private local instance will see it, so that a request that cannot fit is reported before any Ray process
    starts."""
    cluster = cluster if cluster is not None else local_cluster()
    n_actors = n_actors_for(cfg, cluster)
    resources = plan_actor_resources(cfg, n_actors, cluster)
    check_fits(resources, n_actors, cluster, cfg.clients)
    return n_actors, resources
