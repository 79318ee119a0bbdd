"""Shared fixtures: a private Ray instance per test session, tiny configs, a private MLflow store."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance needs no token
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def tiny(**overrides):
    """A config that trains in well under a second per round on synthetic data."""
    from rayfl.config import make_config

    values = {"dataset": "synthetic", "partition": "iid", "clients": 3, "rounds": 2, "samples_per_client": 60,
              "lr": 0.1, "batch_size": 16}
    values.update(overrides)
    return make_config(None, values)


@pytest.fixture(scope="session")
def ray_session():
    """Our own Ray instance (never someone else's), shut down at the end; never `ray stop`."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             configure_logging=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def mlflow_uri(tmp_path):
    return f"sqlite:///{tmp_path}/mlflow.db"
