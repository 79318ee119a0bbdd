"""DriverActor: runs the shared round loop with the clients in client actors, and tracks the run.

It answers ``poll`` while ``run`` works (two concurrent calls), so that whoever submitted the run, the
CLI or a Tune trial, sees each round as it ends, and the MLflow run it writes to. When a driver dies, the
submitter starts another (``actors.launch``) with ``resume``: the MLflow run to reopen. The new driver goes
on from the last checkpoint and logs the rounds since again (its predecessor's writer may not have written
them); the submitter shows each round once.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from rayfl.loop import Callback


class RoundQueue(Callback):
    """Round records waiting to be picked up by the submitter."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[dict] = []

    def push(self, item: dict) -> None:
        with self._lock:
            self._items.append({**item, "time": time.time(), "driver_pid": os.getpid()})

    def on_start(self, loop) -> None:
        self.push({"event": "start", "start_step": loop.start_step, "total": len(loop.schedule())})

    def on_setup(self, loop) -> None:
        self.push({"event": "setup"})

    def on_round(self, loop, record) -> None:  # time: when the round ended, evaluation and logging included
        self.push({"step": record.step, "stage": record.stage, "metrics": record.metrics,
                   "participants": len(record.participants), "total": len(loop.schedule())})

    def on_recover(self, loop, event) -> None:
        self.push({"event": "client_restart", **event, "max_restarts": loop.cfg.max_restarts})

    def drain(self) -> list[dict]:
        with self._lock:
            items, self._items = self._items, []
        return items


def wait_for_actors(actors: list, report, every: float = 1.0) -> None:
    """Block until every actor has been constructed, reporting ``{"event": "actors", "ready", "total"}``
    as they come up; an actor whose constructor failed raises here."""
    pending = [a.__ray_ready__.remote() for a in actors]  # Ray's built-in no-op method of every actor
    total, ready = len(pending), 0
    report({"event": "actors", "ready": 0, "total": total})
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=every)
        if done:
            ray.get(done)
            ready += len(done)
            report({"event": "actors", "ready": ready, "total": total})


def _import_mlflow() -> None:
    """MLflow takes seconds to import: done while the client actors start, not after."""
    import mlflow  # noqa: F401


@ray.remote(max_concurrency=2)
class DriverActor:
    def __init__(self, prepared, x_ref, y_ref, resources, n_actors: int, tracking: dict,
                 checkpoint_dir: str | None, actor_options=None, resume: dict | None = None):
        self.prepared, self.x_ref, self.y_ref = prepared, x_ref, y_ref
        self.resources, self.n_actors = resources, n_actors
        self.tracking, self.checkpoint_dir = tracking, checkpoint_dir
        self.actor_options = actor_options
        self.resume = resume or {}
        self.queue = RoundQueue()
        self.loop = None
        self.tracker = None
        # the client actors start now, while this process goes on to import MLflow and open the run
        from rayfl.actors.runtime import RayRuntime

        scheduling = (lambda i: self.actor_options[i]) if self.actor_options else None
        self.runtime = RayRuntime(prepared, x_ref[0], y_ref[0], resources, n_actors, scheduling)
        threading.Thread(target=_import_mlflow, daemon=True).start()

    def run(self) -> dict:
        from rayfl.loop import Loop, RunStopped
        from rayfl.tracking import MlflowTracker

        runtime = self.runtime
        wait_for_actors(runtime.actors, self.queue.push)
        tracker = self.tracker = (MlflowTracker(**self.tracking, run_id=self.resume.get("run_id"))
                                  if self.tracking is not None else None)  # None: benchmarks
        callbacks = [tracker, self.queue] if tracker else [self.queue]
        loop = self.loop = Loop(self.prepared, runtime, callbacks, self.checkpoint_dir)
        try:
            loop.run()
        except RunStopped:
            if tracker:
                tracker.fail("KILLED")
            raise
        except BaseException:
            if tracker:
                tracker.fail()
            raise
        finally:
            runtime.shutdown()
        return {"final": loop.final, "history": loop.history, "per_client": loop.last_eval,
                "run_id": tracker.run_id if tracker else None, "client_restarts": loop.restarts}

    def poll(self) -> dict:
        """Rounds (and client restarts) since the last poll, and the MLflow run id once the run has one."""
        return {"records": self.queue.drain(), "run_id": self.tracker.run_id if self.tracker else None}

    def stop(self) -> None:
        """Ask the loop to end before its next round (the run is closed as KILLED, checkpoints kept)."""
        if self.loop is not None:
            self.loop.stop_requested = True
