"""Submit one experiment to Ray: data into the object store once, a DriverActor, progress as it runs.

A driver actor that dies (its process killed, its node lost) is replaced, at most ``max_restarts`` times:
the new driver goes on from the last checkpoint (from round 1 when there is none) in the same MLflow run.
When it cannot, the MLflow run is closed as FAILED, never left RUNNING.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable

import ray

from rayfl.actors.driver import DriverActor
from rayfl.actors.resources import DRIVER_CPUS, live_nodes, n_actors_for, plan_actor_resources, preflight
from rayfl.actors.runtime import client_blocks, dead_nodes, start_client_actors
from rayfl.config import UserError
from rayfl.divergence import Diverged
from rayfl.plugins import Sealed
from rayfl.progress import stderr_into
from rayfl.ray_compat import node_logs_dir
from rayfl.recovery import NoCapacity


DRIVER_START_SECONDS = 120  # a driver actor answers its first poll once started (MLflow, torch imports)
SETTLE_SECONDS = 15.0  # how long the CPUs of actors just killed may take to show as free again


class DriverLost(RuntimeError):
    """The driver actor died more often than max_restarts allows."""


def launch(prepared, tracking: dict | None, checkpoint_dir: str | None = None,
           on_round: Callable[[dict], None] | None = None, resources=None, driver_options: dict | None = None,
           actor_options: list[dict] | None = None, poll_seconds: float = 0.25,
           stop_grace_seconds: float = 30.0, cluster_may_grow: bool = False,
           on_event: Callable[[dict], None] | None = None, pool=None) -> dict:
    """Run ``prepared`` on the connected Ray cluster; ``on_round`` sees each round's record once, ``on_event``
    the driver's status items (``{"event": "actors", "ready": k, "total": n}``, ...). ``tracking``
    names the MLflow run to log to (None: no MLflow at all, for benchmarks that measure its cost).

    A request larger than the nodes' free room is a user error, unless the connected cluster may grow (an
    autoscaler that can add nodes) or the user set capacity_wait: then it only warns, and the actors wait for
    nodes. Likewise client actors lost with a node: waited for then, else their clients move to the surviving
    actors (actors.runtime).

    ``pool`` (:class:`rayfl.actors.pool.ActorPool`): actors kept from the last run, used when the placement
    has their shape, and where this run's actors stay when it ends cleanly (None: actors are killed at the end)."""
    from rayfl import checkpoint

    cfg = prepared.cfg
    if checkpoint_dir:
        checkpoint.read(checkpoint_dir, cfg)  # a checkpoint of another config or version: refused here
    wait_for_room = _waits_for_room(cfg, cluster_may_grow)
    if actor_options or driver_options:  # a Tune trial's placement: its own actors
        pool = None
    if pool is not None:
        pool.prune()  # a kept actor that died meanwhile holds nothing: it must not count as free room
    if resources is None:
        # each node's free resources (an actor lives on one node), counting what kept actors hold as free
        nodes = _settled_nodes(held=pool.held() if pool is not None else None)
        try:
            n_actors, resources = preflight(cfg, nodes)
        except UserError as e:
            if not (cluster_may_grow and wait_for_room):  # no autoscaler to wait for, nor a wait asked for
                raise
            print(f"rayfl: waiting for the autoscaler: {e}", flush=True)
            n_actors = n_actors_for(cfg, nodes)
            resources = plan_actor_resources(cfg, n_actors, nodes)
    else:
        n_actors = len(actor_options) if actor_options else n_actors_for(cfg, live_nodes())
    ds = prepared.dataset
    x_ref, y_ref = ray.put(ds.x), ray.put(ds.y)
    light = dataclasses.replace(prepared, dataset=dataclasses.replace(ds, x=None, y=None))
    from rayfl.tracking import record_run_id, resumed_tracking

    tracking = resumed_tracking(tracking, checkpoint_dir)  # a checkpoint to go on from: its MLflow run too
    seen = {"run_id": (tracking or {}).get("run_id"), "step": -1, "tracking": tracking,
            "record": lambda run_id: record_run_id(checkpoint_dir, run_id)}  # for --resume
    shape = (n_actors, resources, cfg.max_restarts)
    old_clients = pool.take_clients(shape) if pool is not None else None  # another shape: killed
    old_driver = pool.take_driver() if pool is not None else None
    for attempt in range(cfg.max_restarts + 1):
        resume = {"run_id": seen["run_id"]} if attempt else None
        # the driver and the client actors start side by side (each is a process that imports torch); the
        # driver first: its MLflow work is the longest path to the first round
        args = (Sealed(light), resources, tracking, checkpoint_dir, resume, wait_for_room)
        driver = _set_up(old_driver, args)
        if driver is None:
            driver = DriverActor.options(num_cpus=DRIVER_CPUS, **(driver_options or {})).remote(*args)
        with _ray_warnings_to_log():
            actors, kept, setups, creation = _client_actors(light, x_ref, y_ref, resources, n_actors, actor_options,
                                                            old_clients)
        old_driver = old_clients = None  # (a driver started again gets new actors)
        if on_event:
            on_event({"event": "actors", "ready": 0, "total": n_actors, "time": time.time()})
        result = None
        try:
            result = _follow(driver, actors, seen, on_round, on_event, poll_seconds, stop_grace_seconds,
                             cfg.capacity_wait + DRIVER_START_SECONDS, setups, pool is not None)
        except ray.exceptions.RayActorError as e:
            if isinstance(e, ray.exceptions.RayTaskError):  # the run failed inside a live driver
                raise
            lost = e
            left = cfg.max_restarts - attempt
            gone = dead_nodes([seen["driver_node"]]) if seen.get("driver_node") else []
            why = f"its node {gone[0]} left the cluster" if gone else _first_line(e)
            print(f"rayfl: the driver actor died ({why}); "
                  + (f"starting a new one from the last checkpoint ({left} restart(s) left)" if left else
                     f"giving up after max_restarts={cfg.max_restarts}"), file=sys.stderr, flush=True)
            continue
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (UserError, NoCapacity, Diverged)):
                raise e.cause from None
            raise
        finally:
            if pool is not None and result is not None and not result.get("client_restarts"):
                from rayfl.actors.pool import KeptClients

                for actor in actors:  # (before any later call of this process's: the next run's setup)
                    actor.idle.remote()
                nodes = [p.get("node_id") for p in seen.get("placement") or []]
                pool.keep(driver, KeptClients(shape, actors, creation, nodes if len(nodes) == len(actors) else []),
                          seen.get("driver_node"))
            else:
                for actor in [driver, *actors]:
                    ray.kill(actor)
            del kept  # held until here: a client actor that Ray re-creates is built from them again
        if attempt and tracking and result["run_id"]:
            from rayfl.tracking import tag_driver_restarts

            tag_driver_restarts(tracking["tracking_uri"], result["run_id"], attempt)
        return result
    if tracking and seen["run_id"]:  # a driver that died cannot close its MLflow run: it is closed here
        from rayfl.tracking import close_failed

        close_failed(tracking["tracking_uri"], seen["run_id"], attempt)
    raise DriverLost(f"the driver actor died {cfg.max_restarts + 1} times (max_restarts={cfg.max_restarts}); "
                     f"last: {_first_line(lost)}") from lost


def _waits_for_room(cfg, cluster_may_grow: bool) -> bool:
    """Whether client actors lost with a node wait for room (capacity_wait) rather than their clients moving to
    the surviving actors: when an autoscaler can add a node, or when the user set capacity_wait."""
    from rayfl.config import Config
    from rayfl.multinode import can_grow

    return cfg.capacity_wait != Config.capacity_wait or (cluster_may_grow and can_grow())


def _client_actors(light, x_ref, y_ref, resources, n_actors: int, actor_options, old) -> tuple:
    """The run's client actors: ``old`` ones (kept from the last run, of this shape) set up for this run, else
    new ones. Returns the handles, the refs to hold while they may restart, each actor's setup arguments (None
    for new actors: their constructor's are this run's) and the refs they were created from."""
    import uuid

    key = uuid.uuid4().hex
    if old is not None:
        initial_ref = ray.put(light.initial)
        setups = [(key, sealed, x_ref, y_ref, initial_ref) for sealed in client_blocks(light, n_actors)]
        try:
            ray.get([a.setup.remote(*setup) for a, setup in zip(old.actors, setups)])
            return old.actors, [*old.creation, x_ref, y_ref, initial_ref], setups, old.creation
        except ray.exceptions.RayError:  # one died while kept: new ones, all of them
            for actor in old.actors:
                ray.kill(actor)
    actors, kept = start_client_actors(light, x_ref, y_ref, resources, n_actors, actor_options, key)
    return actors, kept, None, kept


def _set_up(actor, args: tuple):
    """A kept driver given a new run (:meth:`DriverActor.setup`), or None when there is none or it died meanwhile."""
    if actor is None:
        return None
    try:
        ray.get(actor.setup.remote(*args))
        return actor
    except ray.exceptions.RayError:
        ray.kill(actor)
        return None


def _settled_nodes(settle: float = SETTLE_SECONDS, steady: float = 1.5, held: dict | None = None) -> list[dict]:
    """Each live node's free resources once they settle: the actors of a run that just ended give their CPUs
    back a moment after they are killed, so a node short of its total is read again until it is whole, or
    unchanged for ``steady`` seconds (someone else's work), or ``settle`` seconds have passed. ``held``: what
    kept actors hold, by node (:meth:`rayfl.actors.pool.ActorPool.held`), counted as free."""
    total = live_nodes(free=False)
    t0 = time.monotonic()
    nodes, since = _with_held(live_nodes(), held), time.monotonic()
    while nodes != total and time.monotonic() - t0 < settle and time.monotonic() - since < steady:
        time.sleep(0.25)
        now = _with_held(live_nodes(), held)
        if now != nodes:
            nodes, since = now, time.monotonic()
    return nodes


def _with_held(nodes: list[dict], held: dict | None) -> list[dict]:
    """``nodes`` with ``held`` resources added back (those of an unknown node to the only node, if one)."""
    if not held:
        return nodes
    out = []
    for n in nodes:
        extra = [held.get(n["node_id"], {})] + ([held.get("", {})] if len(nodes) == 1 else [])
        out.append({**n, **{k: round(n[k] + sum(e.get(k, 0.0) for e in extra), 6) for k in ("CPU", "GPU")}})
    return out


@contextmanager
def _ray_warnings_to_log():
    """Ray's core worker warns on stderr about each restartable actor with constructor arguments in the object
    store (that they must stay alive: :func:`launch` keeps them): into Ray's log directory, not the console."""
    # connected to a remote cluster: its logs are on its head node
    folder = node_logs_dir() or tempfile.gettempdir()
    with open(os.path.join(folder, "rayfl-submitter.err"), "ab") as f, stderr_into(f):
        yield


def _follow(driver, actors: list, seen: dict, on_round, on_event, poll_seconds: float,
            stop_grace_seconds: float, silence_seconds: float, setups: list | None = None,
            keep: bool = False) -> dict:
    """Run the driver over ``actors`` to its end, passing on each round not shown before; its result.
    A driver that does not answer a poll for ``silence_seconds`` (no room for it to start) ends the run."""
    done = driver.run.remote(actors, setups, keep)
    try:
        while True:
            ready, _ = ray.wait([done], timeout=poll_seconds)
            asked = driver.poll.remote()
            answered, _ = ray.wait([asked], timeout=silence_seconds)
            if not answered:
                raise NoCapacity(f"the driver actor did not answer for {silence_seconds:g}s (capacity_wait plus "
                                 f"{DRIVER_START_SECONDS}s to start): no room for it on the cluster?")
            polled = ray.get(asked)
            if polled["run_id"] and polled["run_id"] != seen["run_id"]:
                seen["record"](polled["run_id"])
                if on_event:  # where to watch it, as soon as it exists
                    on_event({"event": "mlflow_run", "run_id": polled["run_id"],
                              "experiment_id": polled.get("experiment_id")})
            seen["run_id"] = polled["run_id"] or seen["run_id"]
            for rec in polled["records"]:
                seen["driver_node"] = rec.get("driver_node") or seen.get("driver_node")
                if rec.get("event") == "client_restart":
                    print(f"rayfl: client actor lost in round {rec['step'] + 1} ({rec['cause']}); restarted, every "
                          f"client restored to round {rec['from_step'] + 1} and replayed "
                          f"(restart {rec['restarts']} of at most {rec['max_restarts']})", file=sys.stderr, flush=True)
                elif rec.get("event") == "rehost":
                    print(f"rayfl: {rec['what']}, and no room for them: their clients move to the surviving "
                          f"client actors", file=sys.stderr, flush=True)
                elif rec.get("event") == "waiting_for_room":
                    print(f"rayfl: {rec['what']}; waiting up to {rec['seconds']:g}s for room (capacity_wait)",
                          file=sys.stderr, flush=True)
                elif "event" in rec:
                    if rec["event"] == "start":  # where each client actor is (what a kept actor holds where)
                        seen["placement"] = rec.get("placement")
                    if on_event:
                        on_event(rec)
                elif rec["step"] > seen["step"]:
                    seen["step"] = rec["step"]
                    if on_round:
                        on_round(rec)
            if ready:
                return ray.get(done)
    except ray.exceptions.RayActorError as e:
        if not isinstance(e, ray.exceptions.RayTaskError):
            raise  # the driver is dead: nothing to stop
        _stop(driver, done, stop_grace_seconds)
        raise
    except BaseException:
        # Interrupted here (Ctrl-C, a failing callback): let the driver close its MLflow run cleanly; a driver
        # still in a round after the grace is killed, and its run closed as KILLED here (what it sent is kept).
        if not _stop(driver, done, stop_grace_seconds) and seen.get("tracking") and seen["run_id"]:
            from rayfl.tracking import close_run

            close_run(seen["tracking"]["tracking_uri"], seen["run_id"], "KILLED")
        raise


def _stop(driver, done, grace: float) -> bool:
    """Ask the driver to stop; whether its run ended within ``grace`` seconds."""
    try:
        driver.stop.remote()
        ready, _ = ray.wait([done], timeout=grace)
        return bool(ready)
    except ray.exceptions.RayError:
        return True


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
