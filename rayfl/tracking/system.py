"""System metrics of a run: MLflow's own samplers (CPU and memory, disk, network, and each GPU where pynvml or
pyrsmi sees one), as MLflow's ``start_run(log_system_metrics=True)`` logs them (``system/cpu_utilization_percentage``,
``system/system_memory_usage_megabytes``, ...: the run page's "System metrics" section). rayfl opens its runs with
``MlflowClient.create_run``, which MLflow's switch does not reach, and sends what a run logs through its own
writer (a run's records wait out a tracking server that is away): so the sampling thread is ours, and it hands
each sample to a function instead of calling the store.

A sample is the mean of one interval (``psutil.cpu_percent`` measures since its previous call), taken at the
interval's end; stopping takes the sample of the interval under way, so a run shorter than one interval still
has one point, and stopping never waits out an interval.
"""

from __future__ import annotations

import threading
from typing import Callable

PREFIX = "system/"  # MLflow's (SystemMetricsMonitor._metrics_prefix): the UI's "System metrics" section


class SystemMetrics:
    """Samples every ``interval`` seconds, each handed to ``deliver(metrics, step)`` (steps 0, 1, ...), from a
    daemon thread until :meth:`stop`. ``deliver`` runs on that thread: a run's queues the sample for its writer,
    a parent run's sends it (and :meth:`stop` waits for it at most its ``timeout``)."""

    def __init__(self, run_id: str, uri: str, interval: float, deliver: Callable[[dict[str, float], int], None]):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.interval, self.deliver = float(interval), deliver
        # MLflow's samplers (its GPU one where a GPU library answers); its own thread is never started
        self._mlflow = SystemMetricsMonitor(run_id, sampling_interval=self.interval, tracking_uri=uri)
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="rayfl-system-metrics", daemon=True)

    def start(self) -> "SystemMetrics":
        self._sample()  # primes psutil's CPU counter: the first interval's utilization is measured from here
        self._clear()
        self._thread.start()
        return self

    def _work(self) -> None:
        while True:
            stopped = self._stop.wait(self.interval)
            try:
                self._sample()
                metrics = self._aggregate()
            except Exception:  # noqa: BLE001 - a sampler that fails (a GPU gone) ends the sampling, not the run
                return
            if metrics:
                self.deliver({PREFIX + k: float(v) for k, v in metrics.items()}, self.step)
                self.step += 1
            if stopped:
                return

    def _sample(self) -> None:
        self._mlflow.collect_metrics()

    def _aggregate(self) -> dict[str, float]:
        metrics = self._mlflow.aggregate_metrics()
        self._clear()
        return metrics

    def _clear(self) -> None:
        for monitor in self._mlflow.monitors:
            monitor.clear_metrics()

    def stop(self, timeout: float | None = None) -> None:
        """The last sample (the interval under way) delivered, the thread ended: at once, but for a ``deliver``
        that blocks (at most ``timeout`` seconds then; the thread is a daemon)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
