"""The algorithm registry: each module in MODULES defines ``ALGORITHMS`` (a list of Algorithm)."""

from __future__ import annotations

import importlib

from rayfl.algorithms.base import Algorithm

MODULES = ("baselines", "fedfomo", "persfl", "federico", "usercentric", "fedmoe")


def _registry() -> dict[str, Algorithm]:
    found: dict[str, Algorithm] = {}
    for mod in MODULES:
        try:
            module = importlib.import_module(f"rayfl.algorithms.{mod}")
        except ModuleNotFoundError as e:
            if e.name == f"rayfl.algorithms.{mod}":
                continue  # not written yet
            raise
        for algo in module.ALGORITHMS:
            found[algo.name] = algo
    return found


def algorithm_names() -> list[str]:
    return list(_registry())


def get_algorithm(name: str) -> Algorithm:
    reg = _registry()
    if name not in reg:
        raise KeyError(f"algo={name!r}: unknown; allowed: {', '.join(reg)}")
    return reg[name]
