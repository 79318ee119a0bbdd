"""MLflow's system metrics (CPU, memory, disk, network; GPU where pynvml sees one) for a run and for a parent run,
sampled every ``system_metrics_interval`` seconds (0: none) by a thread that ends with the run, at once."""

from __future__ import annotations

import math
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from conftest import tiny
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime
from rayfl.tracking import MlflowTracker, ParentRun, ensure_experiment
from rayfl.tracking.system import SystemMetrics

CPU, MEMORY = "system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"


def samplers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rayfl-system-metrics"]


def _run(tmp_path, interval: float) -> tuple[MlflowClient, str, float]:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = prepare(tiny(algo="fedavg", rounds=3, system_metrics_interval=interval))
    tracker = MlflowTracker(uri, experiment="t")
    t0 = time.monotonic()
    Loop(p, LocalRuntime(p), [tracker], None).run()
    return MlflowClient(uri), tracker.run_id, time.monotonic() - t0


def test_a_run_logs_mlflows_cpu_and_memory_samples_and_leaves_no_thread(tmp_path):
    import psutil

    client, run_id, _ = _run(tmp_path, 0.2)
    assert not samplers()  # the sampling thread ended with the run
    metrics = client.get_run(run_id).data.metrics
    assert {CPU, MEMORY, "system/system_memory_usage_percentage"} <= set(metrics), sorted(metrics)
    cpu = client.get_metric_history(run_id, CPU)
    assert [m.step for m in sorted(cpu, key=lambda m: m.step)] == list(range(len(cpu)))  # one point per sample
    assert all(0.0 <= m.value <= 100.0 * psutil.cpu_count() for m in cpu)
    total_mb = psutil.virtual_memory().total / 1e6
    assert all(0.0 < m.value <= total_mb for m in client.get_metric_history(run_id, MEMORY))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_interval_zero_logs_no_system_metrics_and_starts_no_thread(tmp_path):
    client, run_id, _ = _run(tmp_path, 0)
    assert not [k for k in client.get_run(run_id).data.metrics if k.startswith("system/")]
    assert not samplers()


def test_a_run_shorter_than_one_interval_ends_at_once_with_one_sample(tmp_path):
    client, run_id, _ = _run(tmp_path, 10_000)  # an interval far longer than the run
    assert [m.step for m in client.get_metric_history(run_id, CPU)] == [0]  # the interval under way, taken at the end
    assert not samplers()
    got = []
    sampler = SystemMetrics("run", f"sqlite:///{tmp_path}/mlflow.db", 10_000, lambda m, step: got.append((step, m)))
    sampler.start()
    t0 = time.monotonic()
    sampler.stop()
    assert time.monotonic() - t0 < 2.0 and not samplers()  # stopping does not wait out the interval
    assert [step for step, _ in got] == [0] and {CPU, MEMORY} <= set(got[0][1])


def test_a_parent_run_samples_until_it_ends(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = ParentRun.create(uri, ensure_experiment(uri, "t"), "sweep", {})
    parent.sample_system(0.2)
    time.sleep(0.6)
    parent.end("FINISHED")
    assert not samplers()
    history = MlflowClient(uri).get_metric_history(parent.run_id, CPU)
    assert len(history) >= 2 and {m.step for m in history} == set(range(len(history)))
    quiet = ParentRun.create(uri, ensure_experiment(uri, "t"), "off", {})
    quiet.sample_system(0)
    quiet.end("FINISHED")
    assert not [k for k in MlflowClient(uri).get_run(quiet.run_id).data.metrics if k.startswith("system/")]


@pytest.mark.parametrize("interval", [-1.0, math.nan, math.inf])
def test_the_interval_must_be_a_finite_number_of_seconds_at_least_zero(interval):
    with pytest.raises(UserError, match=r"^system_metrics_interval=\S+: must be a finite number"):
        tiny(system_metrics_interval=interval).check()
