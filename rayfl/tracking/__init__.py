"""Experiment tracking behind one port: the only package of rayfl that imports MLflow.

- :mod:`~rayfl.tracking.tables`: a run's results as tables and text (no MLflow);
- :mod:`~rayfl.tracking.store`: the tracking URI, checks of a store before anything starts, the experiment;
- :mod:`~rayfl.tracking.writer`: the background thread that does a run's logging;
- :mod:`~rayfl.tracking.system`: MLflow's system metrics (CPU, memory, GPU), sampled while a run lasts;
- :mod:`~rayfl.tracking.callback`: :class:`MlflowTracker`, the loop callback that logs a run;
- :mod:`~rayfl.tracking.outbox`: what a run has not delivered yet, and ``rayfl sync``;
- :mod:`~rayfl.tracking.runs`: parent runs, runs a dead driver left, the run id a run directory records.

The names below are loaded on first use (``from rayfl.tracking import numeric`` imports only the tables), so
that importing one light part does not import the loop, pandas or MLflow.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "tables": ("CLIENT_PREFIX", "SELECTION_PREFIX", "best_trial_line", "client_table", "final_summary", "headline",
               "numeric", "pick_rounds", "rounds_table", "setting", "summary_markdown", "write_client_table"),
    "store": ("CONNECT_TIMEOUT_S", "DEFAULT_TRACKING_URI", "answers", "artifact_root", "check_tracking_store",
              "ensure_experiment", "resolve_tracking_uri", "server_address", "store_error", "tracking_server_problem",
              "unreachable"),
    "writer": ("WRITER_NICER", "Writer", "yield_cpu"),
    "callback": ("FAIL_WAIT", "METRICS_EVERY", "MlflowTracker", "unsent_line"),
    "outbox": ("Outbox", "Sender", "kept_line", "kept_runs", "metrics_record", "outbox_dir", "sync", "sync_run"),
    "runs": ("ParentRun", "close_failed", "close_run", "record_run_id", "recorded_run_id", "resumed_tracking",
             "run_experiment", "tag_driver_restarts"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'rayfl.tracking' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rayfl.tracking.{module}"), name)
    globals()[name] = value
    return value
