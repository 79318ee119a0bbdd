"""Trial resources: one placement group per trial (:func:`trial_bundles`). A trial whose share of the cluster
holds one client actor runs its clients in its own process: one bundle, and Tune reuses that process for the
next trial, so a sweep of small trials pays Ray's start-up once per process, not per trial. A larger share
gets ``[trial, driver, one bundle per client actor]``, the driver and every client actor pinned to their
bundle index, so concurrent trials never take each other's CPUs or GPUs and a trial's actors go when its
group goes.
"""

from __future__ import annotations

from rayfl.config import make_config
from rayfl.sweep.space import trial_values

TRIAL_CPUS = 0.05  # the trial function mostly waits on its driver


# --------------------------------------------------------------------------------------------------
# Resources: one placement group per trial
# --------------------------------------------------------------------------------------------------
def trial_bundles(cfg, share: dict) -> list[dict]:
    """``[trial, driver, client actor 0, ...]`` for one trial with ``share`` of the cluster
    (``{"CPU": c, "GPU": g}`` = cluster / max concurrent trials), every actor asking exactly its bundle;
    ``[trial]`` alone (an in-process trial) when the share holds one client actor."""
    from rayfl.actors.resources import DRIVER_CPUS, n_actors_for, plan_actor_resources

    if in_process(cfg, share):  # the trial's own process is its one client actor
        cpus = cfg.cpus_per_actor or min(float(cfg.torch_threads), share["CPU"])
        return [_bundle(cpus, plan_actor_resources(cfg, 1, share).num_gpus)]
    room = {"CPU": share["CPU"] - TRIAL_CPUS, "GPU": share.get("GPU", 0.0)}
    n_actors = n_actors_for(cfg, room)
    res = plan_actor_resources(cfg, n_actors, room)
    return [{"CPU": TRIAL_CPUS}, {"CPU": DRIVER_CPUS}] + [_bundle(res.num_cpus, res.num_gpus) for _ in range(n_actors)]


def _bundle(cpus: float, gpus: float) -> dict:
    return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}


def in_process(cfg, share: dict) -> bool:
    """Whether a trial with ``share`` of the cluster runs its clients in its own process: its placement
    would be one client actor (``clients_per_actor`` covering every client, or auto with one slot)."""
    from rayfl.actors.resources import n_actors_for

    return n_actors_for(cfg, share) == 1


def _bundles_for(config: dict, base: dict, share: dict) -> list[dict]:
    from rayfl.sweep.records import sampled

    return trial_bundles(make_config(None, trial_values(base, sampled(config))), share)


def _pg_factory(config: dict, base: dict, share: dict):
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory(_bundles_for(config, base, share), strategy="PACK")


def bundle_total(bundles: list[dict]) -> dict:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = round(total.get(k, 0.0) + v, 4)
    return total
