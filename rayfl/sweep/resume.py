"""``rayfl tune --resume DIR``: what is left of a sweep, rebuilt from rayfl's own plain records only: the sweep's
``rayfl_sweep.json`` (checked key by key, as a space file is), its ``rayfl_trials.json``
(:mod:`rayfl.sweep.records`) and the trials' rayfl checkpoints. A fresh Tuner then runs the unfinished trials,
each going on from its own checkpoint, and the trials never started. Tune's own state files in DIR
(``tuner.pkl``, ``experiment_state-*.json``, searcher state) are pickles or hold pickles: they are never read.

Where a resume writes: into DIR, the MLflow store and the stage cache. A recorded tracking URI or stage cache
is used only when it lies inside DIR or is the default; anything else must be given again on the command line
(``--tracking-uri``, ``--stage-cache``), since a copied or shared sweep directory could point anywhere.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

from rayfl.config import FIELDS, UserError
from rayfl.sweep.space import MAX_TRIALS

SWEEP_FILE = "rayfl_sweep.json"


# --------------------------------------------------------------------------------------------------
# rayfl_sweep.json, checked
# --------------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _choices(*allowed):
    return lambda v: v in allowed, f"one of {', '.join(map(str, allowed))}"


# key -> (check, what is allowed); every key the resume reads
KEYS: dict[str, tuple[Any, str]] = {
    "name": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "algo": (lambda v: isinstance(v, str) and bool(v), "an algorithm name"),
    "base": (lambda v: isinstance(v, dict), "a mapping of config values"),
    "space": (lambda v: isinstance(v, dict) and set(v) <= {"fixed", "grid", "random"}
              and all(isinstance(v.get(s, {}), dict) for s in ("fixed", "grid", "random")),
              "a mapping with sections fixed, grid, random"),
    "space_path": (lambda v: isinstance(v, str), "a path"),
    "swept": (lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of keys"),
    "metric": (lambda v: isinstance(v, str), "a metric name"),
    "mode": _choices("max", "min"),
    "search": _choices("grid", "random", "optuna"),
    "scheduler": _choices("fifo", "asha"),
    "num_samples": (lambda v: _is_int(v) and 1 <= v <= MAX_TRIALS, f"an integer in [1, {MAX_TRIALS:,}]"),
    "n_trials": (lambda v: _is_int(v) and 1 <= v <= MAX_TRIALS, f"an integer in [1, {MAX_TRIALS:,}]"),
    "max_concurrent": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "grace_period": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "share": (lambda v: isinstance(v, dict) and bool(v) and all(k in ("CPU", "GPU") and _number(x) and x >= 0
                                                                  for k, x in v.items()),
              "a mapping of CPU/GPU to numbers >= 0"),
    "tracking_uri": (lambda v: isinstance(v, str) and bool(v), "an MLflow tracking URI"),
    "experiment": (lambda v: isinstance(v, str) and bool(v), "an experiment name"),
    "experiment_id": (lambda v: isinstance(v, str) and bool(v), "an MLflow experiment id"),
    "parent_run_id": (lambda v: isinstance(v, str) and v.isalnum(), "an MLflow run id"),
    "stage_cache": (lambda v: isinstance(v, str), "a directory, or \"\" (off)"),
    "sweep_dir": (lambda v: isinstance(v, str), "the directory the sweep was started in"),
}


def load_meta(sweep_dir: str) -> dict:
    """``DIR/rayfl_sweep.json``, every key the resume uses present and of its kind, and its space and base
    config checked as a new sweep's are; UserError naming the file and the key otherwise."""
    from rayfl.sweep.space import Plan, _algo_knobs, validate_space

    path = os.path.join(sweep_dir, SWEEP_FILE)
    if not os.path.isdir(sweep_dir):
        raise UserError(f"--resume {sweep_dir!r}: no such directory")
    if not os.path.isfile(path):
        raise UserError(f"--resume {sweep_dir!r}: no {SWEEP_FILE} there (not a rayfl sweep directory)")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: must hold a mapping (not written by rayfl tune)")
    for key, (check, allowed) in KEYS.items():
        if key not in meta:
            raise UserError(f"{path}: no key {key!r} (not written by rayfl tune, or the sweep never started)")
        if not check(meta[key]):
            raise UserError(f"{path}: {key}={meta[key]!r}: must be {allowed}")
    if not isinstance(meta.get("provenance", {}), dict):
        raise UserError(f"{path}: provenance: must be a mapping")
    meta["recorded_sweep_dir"] = meta["sweep_dir"]
    meta["sweep_dir"] = os.path.abspath(sweep_dir)
    # Tune writes the sweep where it finds it now, never where the file says it once was
    meta["storage"], meta["run_name"] = os.path.split(meta["sweep_dir"])
    meta["knobs"] = _algo_knobs(meta["algo"])
    space = space_of(meta, path)
    if meta["swept"] != space.swept():
        raise UserError(f"{path}: swept={meta['swept']!r}: must be the space's grid and random keys "
                        f"{space.swept()!r}")
    from rayfl.sweep.search import selectable_metrics

    if meta["metric"] not in selectable_metrics("classification"):
        allowed = ", ".join(selectable_metrics("classification"))
        raise UserError(f"{path}: metric={meta['metric']!r}: allowed: {allowed}")
    if meta["base"].get("algo", meta["algo"]) != meta["algo"]:
        raise UserError(f"{path}: base.algo={meta['base'].get('algo')!r}: must be algo={meta['algo']!r}")
    plan = Plan(meta["algo"], meta["base"], space, meta["knobs"])
    n_grid = validate_space(plan)  # every grid point's config (and the random ranges' corners) checked
    if meta["search"] == "grid" and meta["n_trials"] != n_grid * meta["num_samples"]:
        raise UserError(f"{path}: n_trials={meta['n_trials']}: a grid of {n_grid} point(s) x num_samples="
                        f"{meta['num_samples']} is {n_grid * meta['num_samples']}")
    if meta["search"] != "grid" and meta["n_trials"] != meta["num_samples"]:
        raise UserError(f"{path}: n_trials={meta['n_trials']}: must equal num_samples={meta['num_samples']}")
    meta["plan"] = plan
    return meta


def space_of(meta: dict, path: str):
    """The recorded space, checked as a space file is (a distribution is one of the known kinds, with its
    arguments): it names what Tune will be asked to sample."""
    from rayfl.sweep.space import NOT_IN_SPACE, Space, _distribution

    sp = meta["space"]
    space = Space(path, fixed=dict(sp.get("fixed") or {}))
    for key, values in (sp.get("grid") or {}).items():
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: space.grid.{key}: must be a non-empty list of values")
        space.grid[key] = values
    for key, spec in (sp.get("random") or {}).items():
        space.random[key] = _distribution(f"{path}: space", key, spec)
    for section in ("fixed", "grid", "random"):  # what a space file may set, and nothing else
        for key in getattr(space, section):
            if key in NOT_IN_SPACE or (key == "algo" and section != "fixed") or (
                    key not in FIELDS and key not in meta["knobs"]):
                raise UserError(f"{path}: space.{section}.{key}: not a key a space sets (config fields but "
                                f"{', '.join(sorted(NOT_IN_SPACE))}, and the knobs of {meta['algo']})")
    return space


# --------------------------------------------------------------------------------------------------
# Where the resume writes
# --------------------------------------------------------------------------------------------------
def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def local_store(uri: str) -> str | None:
    """The file or directory a tracking URI writes to on this machine; None for a server."""
    if uri.startswith("sqlite:///"):
        return uri[len("sqlite:///") - 1 if uri.startswith("sqlite:////") else len("sqlite:///"):]
    if uri.startswith("file:"):
        rest = uri[len("file:"):]
        return "/" + rest.lstrip("/") if rest.startswith("/") else rest
    if ":" not in uri:
        return uri
    return None


def choose_destinations(meta: dict, tracking_uri: str | None, stage_cache: str | None) -> list[str]:
    """Set ``meta``'s tracking URI and stage cache for the resume: the ones given now, else the recorded
    ones when they lie inside the sweep directory or are the defaults; returns notes to print."""
    from rayfl.tracking import resolve_tracking_uri

    path = os.path.join(meta["sweep_dir"], SWEEP_FILE)
    notes = []
    if tracking_uri:
        uri = resolve_tracking_uri(tracking_uri)
        if uri != meta["tracking_uri"]:
            notes.append(f"MLflow store {uri} (the sweep was logged to {meta['tracking_uri']})")
        meta["tracking_uri"] = uri
    else:
        recorded = meta["tracking_uri"]
        store = local_store(recorded)
        if recorded != resolve_tracking_uri(None) and not (store and _inside(store, meta["sweep_dir"])):
            raise UserError(f"{path}: tracking_uri={recorded!r}: neither the default MLflow store nor inside the "
                            f"sweep directory; pass --tracking-uri URI to say where this resume logs (that one "
                            f"to go on logging there)")
    if stage_cache is not None:
        meta["stage_cache"] = os.path.abspath(os.path.expanduser(stage_cache)) if stage_cache else ""
    else:
        recorded = meta["stage_cache"]
        default = os.path.join(meta["recorded_sweep_dir"], "stages")
        if recorded and os.path.normpath(recorded) == os.path.normpath(default):
            meta["stage_cache"] = os.path.join(meta["sweep_dir"], "stages")  # the default, where DIR is now
        elif recorded and not _inside(recorded, meta["sweep_dir"]):
            raise UserError(f"{path}: stage_cache={recorded!r}: outside the sweep directory; pass --stage-cache DIR "
                            f"to say where this resume shares stages (that one to go on with it), or "
                            f"--stage-cache '' for none")
    return notes


# --------------------------------------------------------------------------------------------------
# What is left
# --------------------------------------------------------------------------------------------------
def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _draw(domains: dict, keys: list[str], rng) -> dict:
    return {k: _plain(domains[k].sample(random_state=rng)) for k in keys}


def _grid_key(config: dict, keys: list[str]) -> str:
    return json.dumps([config.get(k) for k in keys], sort_keys=True, default=str)


def left_over(meta: dict, records: dict) -> tuple[list[dict], int]:
    """``(configs, n_more)``: the trials to run now, in order: the unfinished ones (each with the key of its
    checkpoint), then those never started (grid: the grid points not yet taken, their random keys drawn anew;
    random: fresh draws); ``n_more``: trials a model-based search (optuna) still has to suggest."""
    import numpy as np

    from rayfl.sweep.search import _search_space
    from rayfl.sweep.records import DONE, STOPPED, TRIAL_KEY

    plan = meta["plan"]
    configs = [{**rec["config"], TRIAL_KEY: key} for key, rec in records.items()
               if rec["status"] not in (DONE, STOPPED)]
    n_left = max(0, meta["n_trials"] - len(records))
    if meta["search"] == "optuna":
        return configs, n_left
    rng = np.random.default_rng([meta["seed"], len(records)])  # not the first draws again
    if meta["search"] == "random":
        domains = _search_space(plan, "random")
        return configs + [_draw(domains, list(domains), rng) for _ in range(n_left)], 0
    grid_keys = list(plan.space.grid)
    domains = _search_space(plan, "random")
    taken: dict[str, int] = {}
    for rec in records.values():
        k = _grid_key(rec["config"], grid_keys)
        taken[k] = taken.get(k, 0) + 1
    points = [dict(zip(grid_keys, combo)) for combo in itertools.product(*(plan.space.grid[k] for k in grid_keys))]
    for _ in range(meta["num_samples"]):
        for point in points:
            k = _grid_key(point, grid_keys)
            if taken.get(k, 0) > 0:
                taken[k] -= 1
                continue
            configs.append({**point, **_draw(domains, list(plan.space.random), rng)})
    return configs, 0


def listed_searcher(configs: list[dict], metric: str, mode: str, then=None):
    """A Tune searcher handing out ``configs`` in order, then (when given) what ``then`` suggests."""
    from ray.tune.search import Searcher

    class Listed(Searcher):
        def __init__(self):
            super().__init__(metric=metric, mode=mode)
            self.todo = [dict(c) for c in configs]
            self.delegated: set[str] = set()

        def set_search_properties(self, metric, mode, config, **spec) -> bool:
            return True

        def suggest(self, trial_id):
            if self.todo:
                return self.todo.pop(0)
            if then is None:
                return Searcher.FINISHED
            suggestion = then.suggest(trial_id)
            if isinstance(suggestion, dict):
                self.delegated.add(trial_id)
            return suggestion

        def on_trial_result(self, trial_id, result):
            if trial_id in self.delegated:
                then.on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id, result=None, error=False):
            if trial_id in self.delegated:
                then.on_trial_complete(trial_id, result=result, error=error)

        def save(self, checkpoint_path):  # nothing to keep: a resume rebuilds from rayfl's records
            pass

    return Listed()


def optuna_after(meta: dict, records: dict):
    """An Optuna searcher that knows the finished trials' results (told, not run again)."""
    from rayfl.sweep.search import _search_alg, _search_space

    _search_alg("optuna", 0, 1, meta["metric"], meta["mode"])  # one line when optuna is missing
    from ray.tune.search.optuna import OptunaSearch

    told = [(rec["config"], rec["result"][meta["metric"]]) for rec in records.values()
            if isinstance(rec["result"].get(meta["metric"]), (int, float))]
    return OptunaSearch(space=_search_space(meta["plan"], "random"), metric=meta["metric"], mode=meta["mode"],
                        seed=meta["seed"] + len(records), points_to_evaluate=[c for c, _ in told] or None,
                        evaluated_rewards=[r for _, r in told] or None)


def check_checkpoints(meta: dict, records: dict) -> None:
    """A continuing trial's checkpoint directory is ``trials/<key>`` inside the sweep: a key is a name."""
    for key in records:
        target = os.path.join(meta["sweep_dir"], "trials", key)
        if not _inside(target, meta["sweep_dir"]):
            raise UserError(f"{os.path.join(meta['sweep_dir'], 'rayfl_trials.json')}: trials.{key}: not a trial key")



def prepare_resume(sweep_dir: str, tracking_uri: str | None = None, stage_cache: str | None = None) -> dict:
    """The sweep's record, where the resume writes, its trials' records and its MLflow parent run, all
    checked (UserError, one line) before Ray starts."""
    from rayfl.sweep.records import read_records

    meta = load_meta(sweep_dir)
    for note in choose_destinations(meta, tracking_uri, stage_cache):
        print(f"rayfl tune: note: {note}", flush=True)
    meta["records"] = read_records(meta["sweep_dir"], meta["swept"])
    check_checkpoints(meta, meta["records"])
    from rayfl import checkpoint

    for key, rec in meta["records"].items():  # a trial that goes on runs these values: checked as a grid point is
        try:
            cfg = meta["plan"].config(rec["config"])
            cfg.check()
        except UserError as e:
            where = os.path.join(meta["sweep_dir"], "rayfl_trials.json")
            raise UserError(f"{where}: trials.{key}.config: {e}") from None
        trial_dir = os.path.join(meta["sweep_dir"], "trials", key)
        if checkpoint.exists(trial_dir):  # an old pickle, another version's or an unreadable file: here, not in Ray
            checkpoint.read(trial_dir, cfg, same_config=False)
    _check_parent(meta)
    return meta


def _check_parent(meta: dict) -> None:
    from rayfl.tracking import run_experiment, store_error

    try:
        experiment_id = run_experiment(meta["tracking_uri"], meta["parent_run_id"])
    except Exception as e:  # noqa: BLE001 - MLflow's errors for a missing run or store vary
        if "not found" in str(e).lower() or "RESOURCE_DOES_NOT_EXIST" in str(e):
            raise UserError(f"tracking_uri={meta['tracking_uri']!r}: the sweep's MLflow parent run "
                            f"{meta['parent_run_id']} is not there; resume with the store the sweep logged to "
                            f"(--tracking-uri)") from None
        raise UserError(store_error(meta["tracking_uri"], meta["experiment"], e)) from None
    if experiment_id != meta["experiment_id"]:
        raise UserError(f"{os.path.join(meta['sweep_dir'], SWEEP_FILE)}: experiment_id={meta['experiment_id']!r}: "
                        f"the parent run {meta['parent_run_id']} is in experiment {experiment_id}")
