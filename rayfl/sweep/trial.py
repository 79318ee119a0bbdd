"""The trial (:func:`run_trial`): one trial is one experiment, run inside the trial's placement group: in the
trial's own process when the group is one bundle, else on a driver and client actors pinned to its bundles
(:mod:`rayfl.sweep.placement`). Each round is a ``tune.report``; the last one is held back until the
experiment (and its MLflow child run) has finished, since under ASHA nothing after the final report is sure
to run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from rayfl.config import FIELDS, make_config
from rayfl.specs import TrackingSpec
from rayfl.sweep.placement import bundle_total
from rayfl.sweep.records import sampled, trial_key
from rayfl.sweep.space import trial_values


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a sweep shares, handed to each trial's process by Tune: the base config, the sweep's
    name, metric and swept knobs, where its runs are logged (the parent run's children) and kept."""

    base: dict  # the config values every trial starts from
    name: str  # the sweep's name
    metric: str
    swept: list[str]
    tracking: TrackingSpec
    experiment_id: str
    parent_run_id: str
    sweep_dir: str
    stage_cache: str = ""  # "": off
    provenance: dict = field(default_factory=dict)
    plugins: Any = None  # rayfl.plugins.carried(): registers the sweep's plugins in the trial's process as it arrives


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def trial_name(swept: dict, values: dict) -> str:
    """Knobs first, so that the MLflow UI's cut-off column still tells trials apart:
    ``lam=0.5,T=5 · persfl-digits-s0``."""
    knobs = ",".join(f"{k}={_show(v)}" for k, v in swept.items())
    what = f"{values['algo']}-{values.get('dataset', FIELDS['dataset'].default)}-s{values.get('seed', 0)}"
    return f"{knobs} · {what}" if knobs else what


# --------------------------------------------------------------------------------------------------
# The trial: one experiment inside the trial's placement group
# --------------------------------------------------------------------------------------------------
def run_trial(config: dict, ctx: TrialContext) -> None:
    from ray import tune
    from ray.util import get_current_placement_group

    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.tracking import numeric

    # its key: the trial it continues (a resumed sweep), else its own id; it names its checkpoint directory
    trial_id = trial_key(config, tune.get_context().get_trial_id())
    config = sampled(config)
    values = trial_values(ctx.base, config)
    values["stage_cache"] = ctx.stage_cache  # trials that agree up to a stage share it ("": off)
    if not values.get("checkpoint_every"):
        values["checkpoint_every"] = 1  # a trial Tune retries after its process died goes on from its last round
    cfg = make_config(None, values)
    prepared = prepare(cfg)

    pg = get_current_placement_group()
    bundles = pg.bundle_specs
    swept = {k: config[k] for k in ctx.swept if k in config}
    tracking = ctx.tracking.for_run(
        trial_name(swept, values), experiment_id=ctx.experiment_id, parent_run_id=ctx.parent_run_id,
        tags={**ctx.provenance, "rayfl.role": "trial", "rayfl.sweep": ctx.name, "rayfl.trial": trial_id,
              "rayfl.selection_metric": ctx.metric},
        extra_params={"tune_role": "trial", "tune_trial_id": trial_id, "tune_sweep": ctx.name,
                      "tune_swept": ",".join(ctx.swept), "tune_bundles": json.dumps(bundles)},
        selection=ctx.metric)  # logged as Selection/<metric> too: MLflow lists it first
    metric = ctx.metric
    state = {"metric": None, "held": None, "rounds_run": 0, "reused": 0}

    def on_round(rec: dict) -> None:
        state["rounds_run"] += 1
        if state["rounds_run"] == 1 and rec["step"] > 0 and not resumed:
            state["reused"] = rec["step"]  # its first rounds came from a stage another trial stored
        m = numeric(rec["metrics"])
        if metric in m:
            state["metric"] = m[metric]
        elif state["metric"] is not None:  # a round without evaluation carries the last value forward
            m[metric] = state["metric"]
        result = {**m, "round": rec["step"] + 1, "total_rounds": rec["total"], "stage": rec["stage"],
                  "evaluated": int("eval_seconds" in m), "rounds_run": state["rounds_run"],
                  "reused_rounds": state["reused"]}
        if rec["step"] + 1 >= rec["total"]:
            state["held"] = result  # the final report waits until MLflow is done (ASHA may stop us there)
            return
        tune.report(result)

    t0 = time.time()
    checkpoint_dir = os.path.join(ctx.sweep_dir, "trials", trial_id)
    resumed = Loop.has_checkpoint(checkpoint_dir)  # Tune retried this trial: it goes on from its own rounds
    if len(bundles) == 1:  # the trial's share holds one client actor: its clients live in this process
        import ray
        import torch

        from rayfl.inprocess import run_in_process

        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"  # as a client actor does
        out = run_in_process(prepared, tracking, checkpoint_dir, on_round, device=device)
    else:  # a driver actor: its dataset has no labels, so the partition report is made here
        from rayfl.data.report import PartitionReport

        tracking["partition"] = PartitionReport.of(prepared).to_dict()
        out = _launch_in_group(prepared, tracking, checkpoint_dir, on_round, pg)
    last = out["final"]  # a trial resumed at its last round reports no round: its final row says which
    final = state["held"] or {**numeric(last), "round": int(last.get("step", -1)) + 1,
                              "total_rounds": int(last.get("step", -1)) + 1, "stage": last.get("stage", ""),
                              "evaluated": int("eval_seconds" in last), "reused_rounds": state["reused"]}
    final.update({"mlflow_run_id": out["run_id"], "trial_seconds": time.time() - t0, "rounds_run": state["rounds_run"],
                  "pg_id": pg.id.hex(), "trial_pid": os.getpid(), "trial_start": t0, "trial_end": time.time(),
                  "bundle_cpus": bundle_total(bundles).get("CPU", 0.0)})
    tune.report(final)


def _launch_in_group(prepared, tracking: dict, checkpoint_dir: str, on_round, pg) -> dict:
    """The trial on a driver actor and client actors, each pinned to its bundle of the trial's group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rayfl.actors.launch import launch
    from rayfl.actors.resources import ActorResources

    bundles = pg.bundle_specs
    n_actors = len(bundles) - 2
    actor = bundles[2]
    resources = ActorResources(float(actor.get("CPU", 0.0)), float(actor.get("GPU", 0.0)))
    pin = lambda i: {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}  # noqa: E731
    return launch(prepared, tracking, checkpoint_dir=checkpoint_dir, on_round=on_round, resources=resources,
                  driver_options=pin(1), actor_options=[pin(2 + i) for i in range(n_actors)])
