"""``rayfl compare``: algorithms x seeds on the same federation, as one paper-style table (see run.py).

Names are imported on first use: ``rayfl run`` builds the compare subcommand's parser at every start."""

_WHERE = {"compare": "rayfl.comparison.run", "CompareResult": "rayfl.comparison.run",
          "PRESETS": "rayfl.comparison.presets", "Preset": "rayfl.comparison.presets"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rayfl.comparison' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
