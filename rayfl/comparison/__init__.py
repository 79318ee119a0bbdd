"""``rayfl compare``: algorithms x seeds on the same federation, as one paper-style table (see run.py)."""

from rayfl.comparison.presets import PRESETS, Preset
from rayfl.comparison.run import CompareResult, compare

__all__ = ["compare", "CompareResult", "PRESETS", "Preset"]
