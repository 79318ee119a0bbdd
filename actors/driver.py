"""DriverActor: runs the shared round loop with the clients in client actors, and tracks the run.

It answers ``poll`` while ``run`` works (two concurrent calls), so that whoever submitted the run, the
CLI or a Tune trial, sees each round as it ends, and the MLflow run it writes to (returned by a poll before
the first round starts). When a driver dies, the
submitter starts another (``actors.launch``) with ``resume``: the MLflow run to reopen. The new driver goes
on from the last checkpoint and logs the rounds since again (its predecessor's writer may not have written
them); the submitter shows each round once.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from rayfl.loop import Callback, round_event


RUN_ID_WAIT = 10.0  # seconds the first round waits for the submitter to have polled the MLflow run id


class RoundQueue(Callback):
    """Round records waiting to be picked up by the submitter."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[dict] = []
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def push(self, item: dict) -> None:
        with self._lock:
            self._items.append({**item, "time": time.time(), "driver_pid": os.getpid(), "driver_node": self.node})

    def on_start(self, loop) -> None:  # placement: each client actor's node, pid, GPUs and clients
        self.push({"event": "start", "start_step": loop.start_step, "total": len(loop.schedule()),
                   "placement": loop.runtime.placement()})

    def on_setup(self, loop) -> None:
        self.push({"event": "setup"})

    def on_round(self, loop, record) -> None:  # time: when the round ended, evaluation and logging included
        self.push(round_event(loop, record))

    def on_recover(self, loop, event) -> None:
        self.push({"event": "client_restart", **event, "max_restarts": loop.cfg.max_restarts})

    def drain(self) -> list[dict]:
        with self._lock:
            items, self._items = self._items, []
        return items


def wait_for_actors(actors: list, report, timeout: float, every: float = 1.0) -> None:
    """Block until every actor has been placed and has built its clients, reporting ``{"event": "actors",
    "ready", "total"}`` as they come up (the submitter reported 0 when it asked for them). NoCapacity when they
    are not all placed within ``timeout`` seconds (capacity_wait: no room for them on the cluster, nor on a
    node an autoscaler added); an actor whose clients failed to build raises here."""
    from rayfl.recovery import NoCapacity

    placed = [a.__ray_ready__.remote() for a in actors]  # Ray's built-in no-op method: answers once placed
    deadline = time.monotonic() + timeout
    while placed:
        _, placed = ray.wait(placed, num_returns=len(placed), timeout=max(0.0, min(every, deadline - time.monotonic())))
        if placed and time.monotonic() >= deadline:
            raise NoCapacity(f"{len(placed)} of {len(actors)} client actors not placed within capacity_wait="
                             f"{timeout:g}s (no room for them on the cluster; it has {_free()} free)")
    pending = [a.info.remote() for a in actors]  # builds each actor's clients (actors.client)
    total, ready = len(pending), 0
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=every)
        if done:
            try:
                ray.get(done)
            except ray.exceptions.RayTaskError as e:  # e.g. a plugin's module missing on an actor's node
                from rayfl.user_input import UserError

                if isinstance(e.cause, UserError):
                    raise UserError(str(e.cause)) from None
                raise
            ready += len(done)
            report({"event": "actors", "ready": ready, "total": total})


def _free() -> str:
    free = ray.available_resources()
    return ", ".join(f"{free.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))


@ray.remote(max_concurrency=2)
class DriverActor:
    def __init__(self, prepared, resources, tracking: dict, checkpoint_dir: str | None, resume: dict | None = None,
                 wait_for_room: bool = True):
        """Started before the run's client actors (so that it gets one of the workers Ray keeps started, and
        its MLflow work begins as early as it can); ``run`` gets their handles. ``prepared`` comes sealed
        (:class:`rayfl.plugins.Sealed`): a plugin's module this node lacks is said by ``run``, in one line."""
        self.sealed, self.resources, self.tracking, self.checkpoint_dir = prepared, resources, tracking, checkpoint_dir
        self.prepared, self.wait_for_room = None, wait_for_room
        self.resume = resume or {}
        self.queue = RoundQueue()
        self.loop = None
        self.tracker = None
        self._run_told = threading.Event()  # a poll has returned the run id

    def setup(self, prepared, resources, tracking: dict, checkpoint_dir: str | None, resume: dict | None = None,
              wait_for_room: bool = True) -> None:
        """Serve another run (arguments as the constructor's), nothing of the last one kept: a driver kept
        between runs (:mod:`rayfl.actors.pool`) has its process's imports and MLflow's already loaded."""
        self.__init__(prepared, resources, tracking, checkpoint_dir, resume, wait_for_room)

    def run(self, actors: list, setups: list | None = None, keep: bool = False) -> dict:
        """The whole run over the client actors ``actors`` (started by the submitter right after this driver;
        ``setups``: those actors' arguments when they were kept from an earlier run, for
        :class:`~rayfl.actors.runtime.RayRuntime`); ``keep``: they outlive the run (the submitter ends them)."""
        from rayfl import checkpoint
        from rayfl.actors.runtime import RayRuntime
        from rayfl.inprocess import execute
        from rayfl.loop import Loop
        from rayfl.recovery import NoCapacity
        from rayfl.tracking import MlflowTracker

        self.prepared = self.sealed.open()  # UserError: a module of a plugin missing on this node
        reopen = {"run_id": self.resume["run_id"]} if self.resume.get("run_id") else {}
        tracker = self.tracker = (MlflowTracker(**{**self.tracking, **reopen})
                                  if self.tracking is not None else None)  # None: benchmarks
        if tracker:
            tracker.on_run = self._told_run
            tracker.open()  # MLflow opens in the background, while the client actors start
        runtime = RayRuntime(self.prepared, actors, self.resources, self.wait_for_room, setups)
        runtime.keep_actors = keep
        runtime.notify = self.queue.push
        try:
            wait_for_actors(runtime.actors, self.queue.push, self.prepared.cfg.capacity_wait)
        except NoCapacity as e:  # e.g. a driver started again after its node was lost, with no room left
            if self.checkpoint_dir and checkpoint.exists(self.checkpoint_dir):
                e.checkpoint = (self.checkpoint_dir, checkpoint.read(self.checkpoint_dir, self.prepared.cfg)["step"])
            if tracker:
                tracker.fail()
            raise
        callbacks = [tracker, self.queue] if tracker else [self.queue]
        self.loop = Loop(self.prepared, runtime, callbacks, self.checkpoint_dir)
        return execute(self.loop, tracker)

    def _told_run(self, run_id: str) -> None:
        """The tracker's run exists: no round starts before a poll has returned its id to the submitter (which
        closes the run, or has a restarted driver go on in it, should this driver die), or RUN_ID_WAIT passed."""
        self._run_told.wait(RUN_ID_WAIT)

    def poll(self) -> dict:
        """Rounds (and client restarts) since the last poll, and the MLflow run id once the run has one."""
        run_id = self.tracker.run_id if self.tracker else None
        if run_id:
            self._run_told.set()
        return {"records": self.queue.drain(), "run_id": run_id,
                "experiment_id": self.tracker.experiment_id if run_id else None}

    def stop(self) -> None:
        """Ask the loop to end before its next round (the run is closed as KILLED, checkpoints kept)."""
        if self.loop is not None:
            self.loop.stop_requested = True
