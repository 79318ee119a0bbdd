"""Shared fixtures (a private Ray instance per test session, tiny configs, a private MLflow store) and the
suite's three layers: tests/unit, tests/integration, tests/system (see the end of this file)."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance needs no token
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# An MLflow server a test starts runs no job consumers (a dozen processes for GenAI jobs rayfl never submits).
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


def tiny(**overrides):
    """A config that trains in well under a second per round on synthetic data."""
    from rayfl.config import make_config

    values = {"dataset": "synthetic", "partition": "iid", "clients": 3, "rounds": 2, "samples_per_client": 60,
              "lr": 0.1, "batch_size": 16}
    values.update(overrides)
    return make_config(None, values)


def same(a, b) -> bool:
    """Equal, type for type (np.float32 is not float, a tuple is not a list), NaN equal to NaN: for state
    that must come back exactly (snapshots, checkpoints, replays)."""
    import math

    import numpy as np
    import pandas as pd
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, pd.DataFrame):
        return list(a.columns) == list(b.columns) and a.equals(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


class Payload:
    """Unpickling this writes the file ``marker``: proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return touch, (self.marker,)


def touch(path):
    with open(path, "w") as f:
        f.write("code ran")


@pytest.fixture(scope="session")
def ray_session():
    """Our own Ray instance (never someone else's), shut down at the end; never `ray stop`."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             configure_logging=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory):
    """An MLflow sqlite store with its tables made, made once: MLflow's schema migrations cost seconds each time
    a store is created, and a copy of this file is the same empty store (the same rows and schema version)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-empty") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, empty_mlflow_store):
    """A private, empty sqlite store in the test's folder."""
    import shutil

    shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


def random_mnist(directory, n: int, seed: int = 0) -> str:
    """n random 28x28 images with labels 0-9 as MNIST t10k IDX files (read through the real loader)."""
    import gzip
    import struct

    import numpy as np

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, "t10k-images-idx3-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">IIII", 2051, n, 28, 28) + rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes())
    with gzip.open(os.path.join(directory, "t10k-labels-idx1-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">II", 2049, n) + rng.integers(0, 10, n, dtype=np.uint8).tobytes())
    return str(directory)


# --------------------------------------------------------------------------------------------------
# Layers: tests/unit (no Ray, no subprocess, no server: `make test-fast`), tests/integration (a local Ray
# instance in this process), tests/system (the command in subprocesses, MLflow servers, multi-node clusters).
# Each test gets its folder's marker (``-m unit``). Under pytest-xdist (``--dist loadgroup``, as `make test`
# runs) unit tests are spread one by one; an integration or system file runs on one worker (its module
# fixtures, a server or a cluster, start once), the multi-node files one after another (one cluster at a time
# on two cores), and the slowest groups start first.
# --------------------------------------------------------------------------------------------------
LAYERS = {"unit": "no Ray, no server, no run of the command in a subprocess",
          "integration": "a local Ray instance in this process",
          "system": "the command in subprocesses, MLflow servers, multi-node Ray clusters"}
CLUSTER_FILES = {"test_multinode.py", "test_node_loss.py", "test_ray_up.py"}
# Test modules share helpers across layers (``from test_faults import ALGOS``), and this folder's own
# helpers (conftest, multinode_cluster) are imported by name: every layer's folder is importable.
for _layer in LAYERS:
    _folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), _layer)
    if _folder not in sys.path:
        sys.path.append(_folder)


def pytest_configure(config):
    for layer, what in LAYERS.items():
        config.addinivalue_line("markers", f"{layer}: tests/{layer}: {what}")
    config.addinivalue_line("markers", "slow: takes minutes (`make test` and .ci/run run it; -m 'not slow' leaves "
                                       "it out)")


def layer_of(path) -> str | None:
    """The layer a test file belongs to: the folder under tests/ it sits in (None for one not placed yet)."""
    from pathlib import Path

    parent = Path(path).parent.name
    return parent if parent in LAYERS else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns xdist_group marks into work units
def pytest_collection_modifyitems(config, items):
    order = {"system": 0, "integration": 1, None: 1, "unit": 2}
    for item in items:
        layer = layer_of(item.path)
        if layer is not None:
            item.add_marker(layer)
        if layer == "unit" and "ray_session" in item.fixturenames:
            raise pytest.UsageError(f"{item.nodeid}: a unit test starts no Ray (ray_session): move it to "
                                    f"tests/integration")
        if layer != "unit":
            name = "multinode" if item.path.name in CLUSTER_FILES else item.path.stem
            item.add_marker(pytest.mark.xdist_group(name))
    items.sort(key=lambda item: (0 if item.path.name in CLUSTER_FILES else 1, order[layer_of(item.path)]))
