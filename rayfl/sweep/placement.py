"""Trial resources: one placement group per trial, ``[trial bundle, driver bundle, one bundle per client
actor]`` (:func:`trial_bundles`); the driver and every client actor are pinned to their bundle index, so
concurrent trials never take each other's CPUs or GPUs and a trial's actors go when its group goes.
"""

from __future__ import annotations

from rayfl.config import FIELDS, make_config

TRIAL_CPUS = 0.05  # the trial function mostly waits on its driver


# --------------------------------------------------------------------------------------------------
# Resources: one placement group per trial
# --------------------------------------------------------------------------------------------------
def trial_bundles(cfg, share: dict) -> list[dict]:
    """``[trial, driver, client actor 0, ...]`` for one trial with ``share`` of the cluster
    (``{"CPU": c, "GPU": g}`` = cluster / max concurrent trials). Every actor asks exactly its bundle."""
    from rayfl.actors.resources import DRIVER_CPUS, n_actors_for, plan_actor_resources

    room = {"CPU": share["CPU"] - TRIAL_CPUS, "GPU": share.get("GPU", 0.0)}
    n_actors = n_actors_for(cfg, room)
    res = plan_actor_resources(cfg, n_actors, room)
    actor = {"CPU": res.num_cpus}
    if res.num_gpus > 0:
        actor["GPU"] = res.num_gpus
    return [{"CPU": TRIAL_CPUS}, {"CPU": DRIVER_CPUS}] + [dict(actor) for _ in range(n_actors)]


def _bundles_for(config: dict, base: dict, share: dict) -> list[dict]:
    values = {k: (dict(v) if k == "params" else v) for k, v in base.items()}
    for key, value in config.items():
        if key in FIELDS:
            values[key] = value
        else:
            values.setdefault("params", {})[key] = value
    return trial_bundles(make_config(None, values), share)


def _pg_factory(config: dict, base: dict, share: dict):
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory(_bundles_for(config, base, share), strategy="PACK")


def bundle_total(bundles: list[dict]) -> dict:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = round(total.get(k, 0.0) + v, 4)
    return total
