"""One experiment through rayfl's public path, on Ray (``launch``, default placement) or in this process
(``LocalRuntime``, as ``rayfl compare --local`` runs it), with the time each of its rounds ended: what the
benchmarks that set the two side by side share."""

from __future__ import annotations

import time
from typing import Callable


def run_experiment(prepared, runtime: str, tracking: dict | None = None, device: str = "cpu",
                   on_event: Callable[[dict], None] | None = None) -> tuple[dict, list[float]]:
    """``runtime``: "ray" (a private local Ray instance for the run) or "local"; ``device`` is for "local"
    (on Ray each client actor picks its own); ``on_event``: the Ray driver's status items (placement, ...).
    Returns the run's outcome and the rounds' end times (on Ray the driver's stamps: the submitter sees a
    round up to a poll later)."""
    from rayfl.actors.launch import launch
    from rayfl.session import init_ray, shutdown_ray
    from rayfl.inprocess import run_in_process

    stamps: list[float] = []
    if runtime == "local":
        out = run_in_process(prepared, tracking, on_round=lambda rec: stamps.append(time.time()), device=device)
    else:
        init_ray(None)
        try:
            out = launch(prepared, tracking, on_round=lambda rec: stamps.append(rec["time"]), on_event=on_event)
        finally:
            shutdown_ray()
    return out, stamps
