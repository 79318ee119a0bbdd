"""Datasets, partitions and per-client splits (no Ray here: the driver builds, the actors materialize)."""

from rayfl.data.datasets import DATASETS, Dataset, load_dataset
from rayfl.data.federation import ClientData, Federation, build_federation, materialize

__all__ = ["DATASETS", "Dataset", "load_dataset", "ClientData", "Federation", "build_federation", "materialize"]
