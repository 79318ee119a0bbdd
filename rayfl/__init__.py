"""rayfl: personalized federated learning experiments on Ray, tracked in MLflow.

``rayfl.run(...)`` one experiment (a :class:`RunResult`), ``rayfl.tune(...)`` a sweep (a :class:`SweepResult`),
``rayfl.compare(...)`` algorithms x seeds (a :class:`CompareResult`); ``help(rayfl.run)`` lists every config key
with its default. ``rayfl.register_algorithm`` / ``register_dataset`` / ``register_model`` make your own known
by name (docs/your_algorithm.md); ``rayfl.sync(run_dir)`` sends what a run kept while its tracking server was
away; ``rayfl.shutdown()`` ends the local Ray instance (and the actors) that ``rayfl.run`` keeps for the next
call. Importing rayfl stays cheap: torch, Ray and MLflow load when a run starts.
"""

__version__ = "0.1.0"

_API = {"run": "rayfl.api", "tune": "rayfl.api", "RunResult": "rayfl.api", "SweepResult": "rayfl.api",
        "SweepFailed": "rayfl.api", "UserError": "rayfl.config", "Diverged": "rayfl.divergence", "Config": "rayfl.config",
        "compare": "rayfl.comparison", "CompareResult": "rayfl.comparison",
        "register_dataset": "rayfl.data.datasets", "DatasetSource": "rayfl.data.datasets",
        "register_model": "rayfl.models", "ModelSource": "rayfl.models", "sync": "rayfl.api",
        "shutdown": "rayfl.api", "register_algorithm": "rayfl.plugins"}

__all__ = ["__version__", *_API]


def __dir__() -> list[str]:
    """The public API (what tab completion offers), loaded or not."""
    return sorted({*__all__, *(k for k in globals() if k.startswith("__") and k != "__getattr__")})


def __getattr__(name: str):
    import importlib

    if name not in _API:
        raise AttributeError(f"module 'rayfl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
