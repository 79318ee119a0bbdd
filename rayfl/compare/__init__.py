"""``rayfl compare``: algorithms x seeds on the same federation, as one paper-style table (see run.py)."""

from rayfl.compare.presets import PRESETS, Preset
from rayfl.compare.run import CompareResult, compare

__all__ = ["compare", "CompareResult", "PRESETS", "Preset"]
