"""Print constraints.txt from the installed environment: the exact version of every distribution that rayfl's
requirements (with the extras ``test`` and ``optuna``) pull in, followed transitively with their extras and
environment markers. Run it in a venv where the suite passes: ``python .ci/constraints.py > constraints.txt``."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT_EXTRAS = ("test", "optuna")
# Packaging tools are left to pip and the build backend (pyproject.toml's build-system asks its own setuptools).
NOT_PINNED = {"pip", "setuptools", "wheel"}


def closure(root: str = "rayfl", extras: tuple[str, ...] = ROOT_EXTRAS) -> dict[str, str]:
    """Canonical name -> ``Name==version`` (the name as its metadata spells it) of every installed distribution
    that ``root`` with ``extras`` requires, directly or not."""
    found: dict[str, tuple[str, str]] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(root, extra) for extra in ("", *extras)]
    while todo:
        name, extra = todo.pop()
        if (canonicalize_name(name), extra) in seen:
            continue
        seen.add((canonicalize_name(name), extra))
        try:
            dist = distribution(name)
        except PackageNotFoundError:  # a requirement for another platform or an extra not installed
            continue
        found[canonicalize_name(name)] = (dist.metadata["Name"], dist.version)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            todo += [(req.name, e) for e in ("", *req.extras)]
    for key in (canonicalize_name(root), *NOT_PINNED):
        found.pop(key, None)
    return {key: f"{spelled}=={version}" for key, (spelled, version) in found.items()}


if __name__ == "__main__":
    pins = closure()
    sys.stdout.write("# The versions the test suite passes with (Python 3.11, Linux x86_64), for\n"
                     "# `pip install -c constraints.txt ...`; regenerate with `python .ci/constraints.py > constraints.txt`.\n")
    sys.stdout.write("".join(f"{pins[k]}\n" for k in sorted(pins)))
