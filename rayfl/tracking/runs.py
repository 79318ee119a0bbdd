"""MLflow runs that the submitting process handles itself: a sweep's or a comparison's parent run, a run its
driver could not end (killed, or dead more often than it may restart), and the run id a run directory records
so that ``--resume`` goes on in the same MLflow run.

The run id travels from the driver to the submitter as a return value (the driver's poll answer, the outcome
of :func:`rayfl.actors.launch.launch` and :func:`rayfl.inprocess.run_in_process`); the submitter, which owns the
run directory, records it there beside ``config.yaml`` and its checkpoints, and gives it back to the tracker of
a resumed run.
"""

from __future__ import annotations

import os

from rayfl.tracking.store import answers, server_address

RUN_ID_FILE = "mlflow_run_id"  # in a run directory: the MLflow run its rounds are logged to
BATCH_PARAMS = 100  # MLflow's limit of params in one log_batch call
SYSTEM_STOP_S = 5.0  # the longest a parent run's end waits for its last system-metrics sample to be sent


def record_run_id(run_dir: str | None, run_id: str | None) -> None:
    """The run directory's record of its MLflow run (written by the process that made the directory)."""
    if not run_dir or not run_id:
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, RUN_ID_FILE), "w") as f:
        f.write(run_id)


def recorded_run_id(run_dir: str | None) -> str | None:
    """The MLflow run a run directory recorded (:func:`record_run_id`), or None."""
    path = os.path.join(run_dir, RUN_ID_FILE) if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def close_run(uri: str, run_id: str, status: str) -> None:
    """End an MLflow run that its driver could not end (killed in a round), if the store answers within a few
    seconds and the run is still RUNNING; what it holds is kept."""
    if not answers(server_address(uri), timeout=3.0):
        return
    try:
        client = _client(uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001 - best effort on the way out of an interrupted run
        pass


def tag_driver_restarts(uri: str, run_id: str, restarts: int) -> None:
    """How many times the run's driver actor was started again (the tag ``rayfl.driver_restarts``)."""
    _client(uri).set_tag(run_id, "rayfl.driver_restarts", str(restarts))


def close_failed(uri: str, run_id: str, restarts: int) -> None:
    """A driver that died for good cannot close its MLflow run: tagged with its restarts and ended FAILED here,
    so that no run stays RUNNING."""
    client = _client(uri)
    client.set_tag(run_id, "rayfl.driver_restarts", str(restarts))
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "FAILED")


def run_experiment(uri: str, run_id: str) -> str:
    """The experiment id of an existing MLflow run (MLflow's error when the run or the store is not there)."""
    return _client(uri).get_run(run_id).info.experiment_id


class ParentRun:
    """A sweep's or a comparison's MLflow parent run, which the submitting process writes itself: its trials'
    or rows' runs are children of it (their ``parent_run_id``)."""

    def __init__(self, uri: str, run_id: str):
        import mlflow

        mlflow.set_tracking_uri(uri)  # figures logged through the client go to this store
        self.uri, self.run_id = uri, run_id
        self.client = _client(uri)
        self.system = None  # rayfl.tracking.system.SystemMetrics while this process's are sampled

    @classmethod
    def create(cls, uri: str, experiment_id: str, name: str, tags: dict[str, str],
               params: dict | None = None) -> "ParentRun":
        """A new parent run named ``name``, with ``tags`` and ``params`` (values as text)."""
        run_id = _client(uri).create_run(experiment_id, run_name=name, tags=tags).info.run_id
        run = cls(uri, run_id)
        if params:
            run.log_params(params)
        return run

    @classmethod
    def reopen(cls, uri: str, run_id: str) -> "ParentRun":
        """An existing parent run (a resumed sweep), RUNNING again."""
        run = cls(uri, run_id)
        run.client.update_run(run_id, status="RUNNING")
        return run

    def sample_system(self, interval: float) -> None:
        """MLflow's system metrics of this machine (the submitting process's: the sweep's or comparison's own
        work) every ``interval`` seconds until the run ends (:meth:`end`, :meth:`stop_system`); 0: none."""
        if interval > 0 and self.system is None:
            from rayfl.tracking.system import SystemMetrics

            self.system = SystemMetrics(self.run_id, self.uri, interval, self._log_system).start()

    def _log_system(self, metrics: dict[str, float], step: int) -> None:
        """A sample, sent at once (the sampling thread's), or dropped while the tracking server is away."""
        import time

        from mlflow.entities import Metric

        if not answers(server_address(self.uri), timeout=1.0):
            return
        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        except Exception:  # noqa: BLE001 - a sample lost is no reason to stop the sweep or the comparison
            pass

    def stop_system(self) -> None:
        """The last sample sent (waiting at most SYSTEM_STOP_S for the store) and the sampling ended."""
        if self.system is not None:
            self.system.stop(SYSTEM_STOP_S)
            self.system = None

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in params.items()]
        for start in range(0, len(items), BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[start:start + BATCH_PARAMS])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, path: str, artifact_path: str) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def log_figure(self, figure, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_metric(self, key: str, value: float) -> None:
        self.client.log_metric(self.run_id, key, value)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def run_name(self, run_id: str) -> str:
        """Another run's name (a child's, to link it from this run's description)."""
        return self.client.get_run(run_id).info.run_name

    def children(self, experiment_id: str) -> list[tuple[str, dict, str]]:
        """(run id, params, status) of each child run."""
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.run_id}'",
                                       max_results=10_000)
        return [(r.info.run_id, dict(r.data.params), r.info.status) for r in runs]

    def stop_child(self, run_id: str, why: str) -> None:
        """A child run ended KILLED, the tag ``rayfl.stopped`` saying why."""
        self.client.set_tag(run_id, "rayfl.stopped", why)
        self.client.set_terminated(run_id, "KILLED")

    def end(self, status: str) -> None:
        self.stop_system()
        self.client.set_terminated(self.run_id, status)


def resumed_tracking(tracking: dict | None, checkpoint_dir: str | None) -> dict | None:
    """``tracking`` (the tracker's settings) with the MLflow run to go on with when the run goes on from a
    checkpoint in ``checkpoint_dir`` that recorded its run (a resumed run, a retried sweep trial); as given
    otherwise, or when it names a run already."""
    if tracking is None or tracking.get("run_id") or not checkpoint_dir:
        return tracking
    from rayfl.loop import Loop

    run_id = recorded_run_id(checkpoint_dir) if Loop.has_checkpoint(checkpoint_dir) else None
    return {**tracking, "run_id": run_id} if run_id else tracking
