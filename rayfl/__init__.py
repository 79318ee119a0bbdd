"""rayfl: personalized federated learning experiments on Ray, tracked in MLflow.

``rayfl.run(...)``, ``rayfl.tune(...)`` and ``rayfl.compare(...)`` (see :mod:`rayfl.api`); importing
rayfl stays cheap: torch, Ray and MLflow load when a run starts.
"""

__version__ = "0.1.0"

_API = {"run": "rayfl.api", "tune": "rayfl.api", "RunResult": "rayfl.api", "SweepResult": "rayfl.api",
        "SweepFailed": "rayfl.api", "UserError": "rayfl.config", "Config": "rayfl.config"}

__all__ = ["__version__", "compare", *_API]


def __getattr__(name: str):
    import importlib

    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
    elif name == "compare":
        # rayfl/compare (issue 11) holds compare(algos, seeds, preset=None, **config); importing it makes
        # the attribute the module, so bind the function over it.
        try:
            module = importlib.import_module("rayfl.compare")
        except ModuleNotFoundError as e:
            if e.name != "rayfl.compare":
                raise
            raise AttributeError("rayfl.compare is not in this version of rayfl") from None
        value = getattr(module, "compare", None)
        if not callable(value):
            raise AttributeError("rayfl.compare: the rayfl.compare module has no compare() function")
    else:
        raise AttributeError(f"module 'rayfl' has no attribute {name!r}")
    globals()[name] = value
    return value
