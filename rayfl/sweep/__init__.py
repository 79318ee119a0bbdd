"""``rayfl tune``: a Ray Tune sweep over an algorithm's search space, every trial a whole experiment.

The pieces: :mod:`~rayfl.sweep.space` (space files: parsing, planning, validation),
:mod:`~rayfl.sweep.placement` (a trial's placement-group bundles), :mod:`~rayfl.sweep.trial` (the trial
function; trials share stages through the platform's :mod:`rayfl.stage_cache`),
:mod:`~rayfl.sweep.progress` (console progress), :mod:`~rayfl.sweep.records` (the sweep's own plain record of
its trials), :mod:`~rayfl.sweep.resume` (what is left of an interrupted sweep, from those records),
:mod:`~rayfl.sweep.search` (the space as Tune's distributions, the search algorithm) and
:mod:`~rayfl.sweep.command` (the parser, running a :class:`rayfl.specs.SweepSpec`: the
Tuner, the results table and the MLflow parent run).
"""

from rayfl.sweep.command import add_tune_parser, cmd_tune, results_table
from rayfl.sweep.placement import bundle_total, trial_bundles
from rayfl.sweep.space import Plan, Space, corners, find_space_file, load_space, plan_sweep, space_dirs, validate_space
from rayfl.sweep.trial import run_trial, trial_name

__all__ = [
    "Plan", "Space", "add_tune_parser", "bundle_total", "cmd_tune", "corners", "find_space_file",
    "load_space", "plan_sweep", "results_table", "run_trial", "space_dirs", "trial_bundles",
    "trial_name", "validate_space",
]
