"""``rayfl tune``: a Ray Tune sweep over an algorithm's search space, every trial a whole experiment.

The pieces: :mod:`~rayfl.sweep.space` (space files: parsing, planning, validation),
:mod:`~rayfl.sweep.placement` (a trial's placement-group bundles), :mod:`~rayfl.sweep.stage1` (PersFL's
shared stage 1: key, lock, warm-up), :mod:`~rayfl.sweep.trial` (the trial function),
:mod:`~rayfl.sweep.progress` (console progress) and :mod:`~rayfl.sweep.command` (the parser, running the
Tuner, the results table and the MLflow parent run).
"""

from rayfl.sweep.command import add_tune_parser, cmd_tune, results_table
from rayfl.sweep.placement import bundle_total, trial_bundles
from rayfl.sweep.space import Plan, Space, corners, find_space_file, load_space, plan_sweep, space_dirs, validate_space
from rayfl.sweep.stage1 import Stage1Lock, stage1_groups, stage1_key, stage1_ready, warm_stage1
from rayfl.sweep.trial import run_trial

__all__ = [
    "Plan", "Space", "Stage1Lock", "add_tune_parser", "bundle_total", "cmd_tune", "corners", "find_space_file",
    "load_space", "plan_sweep", "results_table", "run_trial", "space_dirs", "stage1_groups", "stage1_key",
    "stage1_ready", "trial_bundles", "validate_space", "warm_stage1",
]
