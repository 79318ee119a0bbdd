"""Submit one experiment to Ray: data into the object store once, a DriverActor, progress as it runs."""

from __future__ import annotations

import dataclasses
from typing import Callable

import ray

from rayfl.actors.driver import DriverActor
from rayfl.actors.resources import DRIVER_CPUS, n_actors_for, plan_actor_resources, preflight
from rayfl.config import UserError


def launch(prepared, tracking: dict | None, checkpoint_dir: str | None = None,
           on_round: Callable[[dict], None] | None = None, resources=None, driver_options: dict | None = None,
           actor_options: list[dict] | None = None, poll_seconds: float = 0.25,
           stop_grace_seconds: float = 30.0, cluster_may_grow: bool = False,
           on_event: Callable[[dict], None] | None = None) -> dict:
    """Run ``prepared`` on the connected Ray cluster; ``on_round`` sees each round's record, ``on_event``
    the driver's status items (``{"event": "actors", "ready": k, "total": n}``, ...). ``tracking``
    names the MLflow run to log to (None: no MLflow at all, for benchmarks that measure its cost).

    A request larger than the cluster is a user error on a private local instance; on a cluster that
    may grow (an autoscaling one we connected to) it only warns, and the actors wait for nodes."""
    cfg = prepared.cfg
    if resources is None:
        try:
            n_actors, resources = preflight(cfg, ray.cluster_resources())
        except UserError as e:
            if not cluster_may_grow:
                raise
            print(f"rayfl: waiting for the autoscaler: {e}", flush=True)
            n_actors = n_actors_for(cfg, ray.cluster_resources())
            resources = plan_actor_resources(cfg, n_actors, ray.cluster_resources())
    else:
        n_actors = len(actor_options) if actor_options else n_actors_for(cfg, ray.cluster_resources())
    ds = prepared.dataset
    # Wrapped in a list so the driver receives the refs themselves, not the arrays.
    x_ref, y_ref = [ray.put(ds.x)], [ray.put(ds.y)]
    light = dataclasses.replace(prepared, dataset=dataclasses.replace(ds, x=None, y=None))
    driver = DriverActor.options(num_cpus=DRIVER_CPUS, **(driver_options or {})).remote(
        light, x_ref, y_ref, resources, n_actors, tracking, checkpoint_dir, actor_options)
    done = driver.run.remote()
    try:
        while True:
            ready, _ = ray.wait([done], timeout=poll_seconds)
            for rec in ray.get(driver.poll.remote()):
                if "event" in rec:
                    if on_event:
                        on_event(rec)
                elif on_round:
                    on_round(rec)
            if ready:
                return ray.get(done)
    except BaseException:
        # Interrupted here (Ctrl-C, a failing callback): let the driver close its MLflow run cleanly.
        driver.stop.remote()
        ray.wait([done], timeout=stop_grace_seconds)
        raise
    finally:
        ray.kill(driver)
