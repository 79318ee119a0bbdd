"""How many client actors a run gets and how many CPUs and GPUs each asks for, from what the cluster reports.

Placement is automatic by default (``clients_per_actor: auto``): one client actor per client while the
cluster has a slot for each (a share of ``torch_threads`` CPUs, within memory), otherwise one actor per
slot with the clients spread evenly. A slot is a CPU share also when there are GPUs: the GPUs are then
divided among the actors.

Fractional GPUs let several client actors share one GPU (Ray sets CUDA_VISIBLE_DEVICES for each);
an explicit ``num_cpus`` is always given, since an actor without one still reserves a whole CPU for
scheduling and the third actor on a 2-core machine would never start.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

DRIVER_CPUS = 0.05  # the driver actor mostly waits on its clients
ACTOR_MEMORY = 0.5 * 2**30  # a process that imports torch: ~470 MiB unique memory, measured (notes §5)


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float

    def options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


def slots(cfg, cluster: dict) -> int:
    """Client actors the cluster has room for: one per ``cpus_per_actor`` (else ``torch_threads``) CPUs, the
    driver's small share allowed for, and no more than memory holds at ACTOR_MEMORY each."""
    per = cfg.cpus_per_actor or cfg.torch_threads
    by_cpu = math.floor(float(cluster.get("CPU", 1.0)) / per + DRIVER_CPUS * 2)
    memory = float(cluster.get("memory", 0.0))
    by_memory = math.floor(memory / ACTOR_MEMORY) if memory else by_cpu
    return max(1, min(by_cpu, by_memory))


def n_actors_for(cfg, cluster: dict) -> int:
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


def _floor(x: float, step: float = 0.01) -> float:
    return max(step, math.floor(x / step + 1e-9) * step)


def plan_actor_resources(cfg, n_actors: int, cluster: dict) -> ActorResources:
    """Per-actor CPUs and GPUs: the user's values where given, else an even share of the cluster.

    ``cluster`` is what ``ray.cluster_resources()`` (or a trial's reservation) reports.
    """
    total_cpus = float(cluster.get("CPU", 1.0))
    total_gpus = float(cluster.get("GPU", 0.0))
    if cfg.cpus_per_actor > 0:
        cpus = cfg.cpus_per_actor
    else:
        cpus = min(float(cfg.torch_threads), _floor((total_cpus - DRIVER_CPUS) / n_actors))
    if cfg.gpus_per_actor >= 0:
        gpus = cfg.gpus_per_actor
    elif total_gpus > 0:
        gpus = min(1.0, _floor(total_gpus / n_actors, 0.0001))
    else:
        gpus = 0.0
    return ActorResources(round(cpus, 4), round(gpus, 4))


def check_fits(res: ActorResources, n_actors: int, cluster: dict, n_clients: int | None = None) -> None:
    """A request the cluster cannot hold would wait forever, or end in Ray's out-of-memory killer: say so
    instead, before any actor starts."""
    from rayfl.config import UserError

    for kind, per in (("CPU", res.num_cpus), ("GPU", res.num_gpus)):
        need = per * n_actors + (DRIVER_CPUS if kind == "CPU" else 0)
        have = float(cluster.get(kind, 0.0))
        if per > 0 and need > have + 1e-9:
            flag = "cpus_per_actor" if kind == "CPU" else "gpus_per_actor"
            raise UserError(f"{flag}={per:g} x {n_actors} client actors needs {need:g} {kind}s, the cluster has "
                            f"{have:g}; lower it, raise clients_per_actor, or leave both automatic")
    memory = float(cluster.get("memory", 0.0))
    if memory and n_actors * ACTOR_MEMORY > memory:
        fit = max(1, int(memory // ACTOR_MEMORY))
        hint = f" (at most {fit} actors fit: clients_per_actor >= {-(-n_clients // fit)})" if n_clients else ""
        raise UserError(f"{n_actors} client actors need about {n_actors * ACTOR_MEMORY / 2**30:.0f} GiB "
                        f"(0.5 GiB each with torch), the cluster offers {memory / 2**30:.0f} GiB; "
                        f"raise clients_per_actor{hint}, or leave it auto")


def preflight(cfg, cluster: dict | None = None) -> tuple[int, ActorResources]:
    """The placement of a run and its resource check, from a cluster description; with none, from this
    machine as a private local instance will see it, so that a request that cannot fit is reported before
    any Ray process starts."""
    cluster = cluster if cluster is not None else local_cluster()
    n_actors = n_actors_for(cfg, cluster)
    resources = plan_actor_resources(cfg, n_actors, cluster)
    check_fits(resources, n_actors, cluster, cfg.clients)
    return n_actors, resources
