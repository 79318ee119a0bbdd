"""Running a loop to its end with its MLflow run closed the way it ended, and an experiment run wholly in
the calling process (clients in a :class:`LocalRuntime`): ``rayfl compare --local`` and a sweep trial whose
share of the cluster holds one client actor, where separate driver and client processes would only add
start-up time.
"""

from __future__ import annotations

from typing import Callable

from rayfl.loop import Callback, Loop, RunStopped, round_event


def execute(loop: Loop, tracker=None) -> dict:
    """``loop.run()``, then the outcome; the tracker's MLflow run ends KILLED when the run was stopped and
    FAILED when it raised, and the runtime is shut down either way."""
    try:
        loop.run()
    except RunStopped:
        if tracker:
            tracker.fail("KILLED")
        raise
    except Exception as e:
        if tracker:
            tracker.fail(why=str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise
    except BaseException:
        if tracker:
            tracker.fail()
        raise
    finally:
        loop.runtime.shutdown()
    return {"final": loop.final, "history": loop.history, "per_client": loop.last_eval,
            "run_id": tracker.run_id if tracker else None,
            "experiment_id": tracker.experiment_id if tracker else None, "client_restarts": loop.restarts,
            "tracking_unsent": tracker.unsent_line() if tracker else None}


class _Rounds(Callback):
    def __init__(self, on_round: Callable[[dict], None]):
        self.on_round_event = on_round

    def on_round(self, loop, record) -> None:
        self.on_round_event(round_event(loop, record))


def run_in_process(prepared, tracking: dict | None, checkpoint_dir: str | None = None,
                   on_round: Callable[[dict], None] | None = None, device: str = "cpu") -> dict:
    """The experiment in this process, as :func:`rayfl.actors.launch.launch` runs it on Ray: the same
    outcome dict, ``on_round`` sees the same round events, ``tracking`` names the MLflow run (None: none),
    ``device`` is where the clients train ("cuda" in a Ray worker given a GPU)."""
    from rayfl.runtime import LocalRuntime
    from rayfl.tracking import MlflowTracker, record_run_id, resumed_tracking

    tracking = resumed_tracking(tracking, checkpoint_dir)  # a checkpoint to go on from: its MLflow run too
    tracker = MlflowTracker(**tracking) if tracking is not None else None
    if tracker:
        tracker.on_run = lambda run_id: record_run_id(checkpoint_dir, run_id)  # for --resume
    callbacks = ([tracker] if tracker else []) + ([_Rounds(on_round)] if on_round else [])
    return execute(Loop(prepared, LocalRuntime(prepared, device=device), callbacks, checkpoint_dir), tracker)
