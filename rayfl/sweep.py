"""``rayfl tune``: a Ray Tune sweep over an algorithm's search space, every trial a whole experiment.

The pieces, top to bottom:

* **Space files** (``tune_spaces/<algo>.yaml``): ``fixed`` values, ``grid`` lists and ``random``
  distributions over Config fields and algorithm knobs. :func:`load_space` reads one and
  :func:`validate_space` builds every grid point's Config (and every corner of the random ranges) and runs
  ``Config.check()`` on it, so a bad key or value is one line naming the file and key, before any trial.
* **Trials** (:func:`run_trial`): one trial is one experiment. Its placement group is
  ``[trial bundle, driver bundle, one bundle per client actor]`` (:func:`trial_bundles`); the driver and
  every client actor are pinned to their bundle index, so concurrent trials never take each other's CPUs or
  GPUs and a trial's actors go when its group goes. Each round is a ``tune.report``; the last one is held
  back until the experiment (and its MLflow child run) has finished, since under ASHA nothing after the
  final report is sure to run.
* **MLflow**: the sweep process creates the parent run; every trial's driver opens a child run with
  ``parent_run_id``; at the end the parent gets the results table (CSV) and a plot of the metric against each
  swept knob.
* **Shared work**: PersFL trials that differ only in (λ, T) share one stage-1 cache directory, keyed by a
  hash of the rest of the resolved config; a lock file makes the first trial compute it while the others
  wait (:class:`Stage1Lock`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from rayfl.config import FIELDS, UserError, make_config, read_yaml

SECTIONS = ("fixed", "grid", "random")
# name -> number of arguments (None: a list of values)
DISTRIBUTIONS = {"uniform": 2, "loguniform": 2, "quniform": 3, "randint": 2, "choice": None}
# Config fields a space may not set: they name where things go, not what runs.
NOT_IN_SPACE = {"params", "run_name", "experiment", "tracking_uri", "out_dir"}
SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("fifo", "asha")
TRIAL_CPUS = 0.05  # the trial function mostly waits on its driver
# Knobs that stage 1 of PersFL does not read (they shape stage 2 only): trials that differ only in these
# share one stage 1. PersFL keeps both teachers (best round and final) in its cache, so `teacher` is free too.
STAGE1_FREE = {"persfl": ("lam", "T", "lam_grid", "T_grid", "distill_epochs", "variant", "teacher", "stage1_cache")}
# Config fields that do not change what an experiment computes (left out of the stage-1 key).
NOT_COMPUTED = {"run_name", "experiment", "tracking_uri", "out_dir", "checkpoint_every"}
# A swept (or fixed) knob that only acts when another knob is set so: PersFL uses its single lam / T only
# when its per-client grid over them is empty (otherwise every trial would run the whole grid inside).
IMPLIES = {"persfl": {"lam": {"lam_grid": ()}, "T": {"T_grid": ()}}}
SWEEP_FILE = "rayfl_sweep.json"


# --------------------------------------------------------------------------------------------------
# Space files
# --------------------------------------------------------------------------------------------------
@dataclass
class Space:
    path: str
    fixed: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)  # key -> list of values
    random: dict = field(default_factory=dict)  # key -> (distribution, args)

    def swept(self) -> list[str]:
        return list(self.grid) + list(self.random)

    def n_grid(self) -> int:
        return math.prod(len(v) for v in self.grid.values()) if self.grid else 1

    def to_dict(self) -> dict:
        return {"fixed": self.fixed, "grid": self.grid,
                "random": {k: {d: list(a) if isinstance(a, tuple) else a} for k, (d, a) in self.random.items()}}


def space_dirs() -> list[str]:
    """Where default space files are looked for: the working directory's ``tune_spaces/`` (a user's own
    or a job's working dir), the source checkout beside the package, and the installed data files."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.join(os.getcwd(), "tune_spaces"), os.path.join(os.path.dirname(here), "tune_spaces"),
            os.path.join(here, "tune_spaces"), os.path.join(sys.prefix, "share", "rayfl", "tune_spaces")]
    if os.environ.get("RAYFL_TUNE_SPACES"):
        dirs.insert(0, os.environ["RAYFL_TUNE_SPACES"])
    out = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def find_space_file(algo: str) -> str:
    for d in space_dirs():
        path = os.path.join(d, f"{algo}.yaml")
        if os.path.isfile(path):
            return path
    raise UserError(f"no search space for algo={algo!r}: looked for {algo}.yaml in {', '.join(space_dirs())}; "
                    f"pass --space FILE")


def load_space(path: str) -> Space:
    """Read and check the shape of a space file; values are checked by :func:`validate_space`."""
    if not os.path.isfile(path):
        raise UserError(f"space file {path!r}: no such file")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"{path}: not valid YAML{at} ({str(getattr(e, 'problem', None) or e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: must hold a mapping with sections {', '.join(SECTIONS)}")
    for section in data:
        if section not in SECTIONS:
            raise UserError(f"{path}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(data[section] or {}, dict):
            raise UserError(f"{path}: {section}: must be a mapping of key: value")
    space = Space(path, fixed=dict(data.get("fixed") or {}))
    seen = {k: "fixed" for k in space.fixed}
    for key, values in (data.get("grid") or {}).items():
        if key in seen:
            raise UserError(f"{path}: grid.{key}: already set in {seen[key]}")
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: grid.{key}: must be a non-empty list of values, e.g. [0.1, 0.5]")
        if len(set(map(repr, values))) != len(values):
            raise UserError(f"{path}: grid.{key}: repeated values in {values}")
        space.grid[key] = values
        seen[key] = "grid"
    for key, spec in (data.get("random") or {}).items():
        if key in seen:
            raise UserError(f"{path}: random.{key}: already set in {seen[key]}")
        space.random[key] = _distribution(path, key, spec)
        seen[key] = "random"
    return space


def _distribution(path: str, key: str, spec: Any) -> tuple[str, Any]:
    where = f"{path}: random.{key}"
    if not isinstance(spec, dict) or len(spec) != 1:
        raise UserError(f"{where}: must be one distribution, e.g. {{uniform: [0, 1]}}; "
                        f"known: {', '.join(DISTRIBUTIONS)}")
    (kind, args), = spec.items()
    if kind not in DISTRIBUTIONS:
        raise UserError(f"{where}: unknown distribution {kind!r}; known: {', '.join(DISTRIBUTIONS)}")
    n = DISTRIBUTIONS[kind]
    if not isinstance(args, list) or (n is None and not args) or (n is not None and len(args) != n):
        what = "a non-empty list of values" if n is None else f"a list of {n} numbers"
        raise UserError(f"{where}: {kind} takes {what}, got {args!r}")
    if kind == "choice":
        return kind, list(args)
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise UserError(f"{where}: {kind} bounds must be numbers, got {args!r}")
    lo, hi = args[0], args[1]
    if not lo < hi if kind != "randint" else not lo <= hi:
        raise UserError(f"{where}: {kind} needs low < high, got {args!r}")
    if kind == "loguniform" and lo <= 0:
        raise UserError(f"{where}: loguniform needs low > 0, got {args!r}")
    if kind == "randint" and not all(float(a).is_integer() for a in args):
        raise UserError(f"{where}: randint bounds must be integers, got {args!r}")
    if kind == "quniform" and not args[2] > 0:
        raise UserError(f"{where}: quniform step must be > 0, got {args!r}")
    return kind, tuple(args)


def corners(kind: str, args) -> list:
    """The extreme values a distribution can give (checked instead of every sample)."""
    if kind == "choice":
        return list(args)
    if kind == "randint":  # both ends included (the space file's reading; Tune's upper end is exclusive)
        return [int(args[0]), int(args[1])]
    if kind == "quniform":
        lo, hi, q = args
        return [round(lo / q) * q, round(hi / q) * q]
    return [args[0], args[1]]


# --------------------------------------------------------------------------------------------------
# Resolving values: defaults < --config file < space fixed < flags; swept values per trial
# --------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Everything a sweep needs, resolved and checked before any trial starts."""

    algo: str
    base: dict  # flat Config values (knobs under "params")
    space: Space
    knobs: list[str]  # the algorithm's knob names
    notes: list[str] = field(default_factory=list)

    def values(self, sample: dict) -> dict:
        """The Config values of one trial: ``base`` with the sampled keys put where they belong."""
        out = {k: (dict(v) if k == "params" else v) for k, v in self.base.items()}
        out.setdefault("params", {})
        for key, value in sample.items():
            if key in FIELDS:
                out[key] = value
            else:
                out["params"][key] = value
        return out

    def config(self, sample: dict):
        return make_config(None, self.values(sample))


def _algo_knobs(algo: str) -> list[str]:
    from rayfl.algorithms import get_algorithm

    try:
        return get_algorithm(algo).param_names()
    except KeyError as e:
        raise UserError(str(e.args[0])) from None


def _field_kind(key: str, algo: str):
    """The Python type of a Config field's or knob's default (int, float, str, bool, tuple, or None)."""
    if key in FIELDS:
        default = FIELDS[key].default
    else:
        from rayfl.algorithms import get_algorithm

        f = {f.name: f for f in dataclasses.fields(get_algorithm(algo).Params)}[key]
        default = f.default
    return None if default is None or default is dataclasses.MISSING else type(default)


def plan_sweep(space: Space, file_values: dict, flag_values: dict, flag_params: dict) -> Plan:
    """Layer the values and check every key of the space against the Config fields and the algorithm's
    knobs. ``file_values`` come from ``--config``, ``flag_values``/``flag_params`` from the command line."""
    path = space.path
    algo = flag_values.get("algo") or file_values.get("algo") or space.fixed.get("algo") or FIELDS["algo"].default
    knobs = _algo_knobs(algo)
    for section in SECTIONS:
        for key in getattr(space, section):
            if key == "algo" and section == "fixed":
                continue
            if key in NOT_IN_SPACE or (key == "algo"):
                raise UserError(f"{path}: {section}.{key}: not something a space sets (it is a flag of `rayfl tune`)")
            if key in FIELDS and key in knobs:
                raise UserError(f"{path}: {section}.{key}: both a config field and a knob of {algo}; ambiguous")
            if key not in FIELDS and key not in knobs:
                raise UserError(f"{path}: {section}.{key}: unknown key: neither a config field nor a knob of "
                                f"{algo!r} (its knobs: {', '.join(knobs) or 'none'})")
    base: dict[str, Any] = {k: v for k, v in file_values.items() if k != "params"}
    params = dict(file_values.get("params") or {})
    for key, value in space.fixed.items():
        if key in FIELDS:
            base[key] = value
        else:
            params[key] = value
    base.update(flag_values)
    for key, implied in IMPLIES.get(algo, {}).items():
        if key in space.grid or key in space.random or key in space.fixed:
            for k, v in implied.items():
                params.setdefault(k, v)
    params.update(flag_params)
    base["algo"] = algo
    base["params"] = params
    notes = []
    for key in list(space.grid) + list(space.random):  # a flag fixes a swept key: out of the search
        if key in flag_values or key in flag_params:
            value = flag_values.get(key, flag_params.get(key))
            notes.append(f"{key} is fixed to {value!r} by a flag (taken out of the search)")
            space.grid.pop(key, None)
            space.random.pop(key, None)
    for key, (kind, _) in space.random.items():
        ftype = _field_kind(key, algo)
        if kind in ("uniform", "loguniform", "quniform") and ftype is int:
            raise UserError(f"{path}: random.{key}: {key} is an integer; {kind} gives real numbers "
                            f"(use randint or choice)")
    return Plan(algo, base, space, knobs, notes)


def validate_space(plan: Plan, max_checks: int = 5000) -> int:
    """Build every grid point's Config, with each corner of the random ranges, and check it; return the
    number of grid points. Errors name the file and the key (or the combination of keys)."""
    path = plan.space.path
    options: dict[str, list] = {k: list(v) for k, v in plan.space.grid.items()}
    options.update({k: corners(*spec) for k, spec in plan.space.random.items()})
    first = {k: v[0] for k, v in options.items()}
    try:
        plan.config(first).check()
    except UserError as e:
        culprit = next((k for k in [*options, *plan.space.fixed] if re.search(rf"(?<![\w.]){re.escape(k)}=", str(e))),
                       None)
        section = "grid" if culprit in plan.space.grid else "random" if culprit in plan.space.random else "fixed"
        raise UserError(f"{path}: {section}.{culprit}: {e}" if culprit else f"{e} (with {path}'s values)") from None
    for key, values in options.items():  # one key at a time, the others at their first value: the error names it
        section = "grid" if key in plan.space.grid else "random"
        for value in values:
            try:
                plan.config({**first, key: value}).check()
            except UserError as e:
                raise UserError(f"{path}: {section}.{key}: {e}") from None
    keys = list(options)
    combos = itertools.product(*(options[k] for k in keys))
    for combo in itertools.islice(combos, max_checks):  # together (val_frac + test_frac < 1, M vs clients)
        sample = dict(zip(keys, combo))
        try:
            plan.config(sample).check()
        except UserError as e:
            named = ", ".join(f"{k}={v!r}" for k, v in sample.items())
            raise UserError(f"{path}: the combination {named}: {e}") from None
    return plan.space.n_grid()


# --------------------------------------------------------------------------------------------------
# Resources: one placement group per trial
# --------------------------------------------------------------------------------------------------
def trial_bundles(cfg, share: dict) -> list[dict]:
    """``[trial, driver, client actor 0, ...]`` for one trial with ``share`` of the cluster
    (``{"CPU": c, "GPU": g}`` = cluster / max concurrent trials). Every actor asks exactly its bundle."""
    from actors.resources import DRIVER_CPUS, plan_actor_resources
    from rayfl.runtime import assign_hosts

    n_actors = len(assign_hosts(cfg.clients, cfg.clients_per_actor))
    res = plan_actor_resources(cfg, n_actors, {"CPU": share["CPU"] - TRIAL_CPUS, "GPU": share.get("GPU", 0.0)})
    actor = {"CPU": res.num_cpus}
    if res.num_gpus > 0:
        actor["GPU"] = res.num_gpus
    return [{"CPU": TRIAL_CPUS}, {"CPU": DRIVER_CPUS}] + [dict(actor) for _ in range(n_actors)]


def _bundles_for(config: dict, base: dict, share: dict) -> list[dict]:
    values = {k: (dict(v) if k == "params" else v) for k, v in base.items()}
    for key, value in config.items():
        if key in FIELDS:
            values[key] = value
        else:
            values.setdefault("params", {})[key] = value
    return trial_bundles(make_config(None, values), share)


def _pg_factory(config: dict, base: dict, share: dict):
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory(_bundles_for(config, base, share), strategy="PACK")


def bundle_total(bundles: list[dict]) -> dict:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = round(total.get(k, 0.0) + v, 4)
    return total


# --------------------------------------------------------------------------------------------------
# PersFL: one stage 1 per distinct rest-of-config
# --------------------------------------------------------------------------------------------------
def stage1_key(values: dict, algo: str) -> str:
    """Hash of everything but the knobs stage 1 does not depend on (seed included)."""
    free = set(STAGE1_FREE.get(algo, ()))
    cfg = make_config(None, values)
    flat = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_COMPUTED and k != "params"}
    from rayfl.algorithms import get_algorithm

    params = dataclasses.asdict(get_algorithm(algo).make_params(cfg.params))
    flat["params"] = {k: v for k, v in params.items() if k not in free}
    text = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Stage1Lock:
    """Only one trial computes a given stage-1 cache; the others wait for it, then read it.

    The lock is a file created with O_EXCL next to the cache directory, holding the owner's host and pid.
    It is released when the owner's experiment ends (or fails); a lock whose owner process is gone (a
    trial stopped or killed) is taken over. Waiting trials hold their placement group meanwhile, which only
    delays them: the owner has its own group.
    """

    def __init__(self, cache_dir: str, poll: float = 0.5):
        self.cache_dir = cache_dir
        self.path = cache_dir.rstrip("/") + ".lock"
        self.poll = poll
        self.held = False

    def _owner_alive(self) -> bool:
        try:
            with open(self.path) as f:
                host, pid = f.read().split()
        except (OSError, ValueError):
            return True  # being written: give it a moment
        if host != os.uname().nodename:
            return True  # another node: trust it
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def acquire(self, ready) -> bool:
        """Wait until ``ready()`` (the cache is complete: return False, nothing to do) or the lock is ours
        (return True: compute it). ``ready`` is checked before each attempt."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        while True:
            if ready():
                return False
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._owner_alive():
                    try:
                        os.unlink(self.path)  # a dead owner's lock
                    except FileNotFoundError:
                        pass
                    continue
                time.sleep(self.poll)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.uname().nodename} {os.getpid()}")
            self.held = True
            if ready():  # finished between our check and our lock
                self.release()
                return False
            return True

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def stage1_ready(cache_dir: str) -> bool:
    """Whether a stage-1 cache is complete: PersFL writes its one file atomically (tmp + rename) when
    stage 1 ends, so its presence is the signal (waiting trials go on then, not when the owner ends)."""
    from rayfl.algorithms.persfl import CACHE_FILE

    return os.path.isfile(os.path.join(cache_dir, CACHE_FILE))


def stage1_groups(plan: Plan, stage1_root: str) -> dict[str, dict] | None:
    """Stage-1 key -> one grid sample of that key, for every grid point; None when a random key that
    stage 1 depends on is swept (the keys are then known only per trial: the trials' lock handles it)."""
    free = set(STAGE1_FREE.get(plan.algo, ()))
    if any(k not in free for k in plan.space.random):
        return None
    keys = [k for k in plan.space.grid if k not in free]
    groups: dict[str, dict] = {}
    firsts = {k: v[0] for k, v in plan.space.grid.items() if k in free}
    for combo in itertools.product(*(plan.space.grid[k] for k in keys)):
        sample = {**firsts, **dict(zip(keys, combo))}
        values = plan.values(sample)
        groups.setdefault(stage1_key(values, plan.algo), sample)
    return groups


def warm_stage1(meta: dict, plan: Plan, quiet: bool) -> None:
    """Before the trials: compute each distinct stage 1 once, with the whole cluster (a plain experiment,
    logged as a child run of the sweep with role ``stage1``), so that every (λ, T) trial only reads it."""
    from actors.launch import launch
    from rayfl.cli import format_round
    from rayfl.experiment import prepare

    groups = stage1_groups(plan, meta["stage1_root"])
    if groups is None:
        print("rayfl tune: stage 1 depends on a randomly drawn key: trials share it through a lock instead",
              flush=True)
        return
    for i, (key, sample) in enumerate(groups.items()):
        cache = os.path.join(meta["stage1_root"], key)
        if stage1_ready(cache):
            continue
        values = plan.values(sample)
        values["params"]["stage1_cache"] = cache
        lock = Stage1Lock(cache)
        if not lock.acquire(lambda: stage1_ready(cache)):
            continue
        try:
            print(f"rayfl tune: stage 1 {i + 1}/{len(groups)} (key {key}, shared by its trials), whole cluster",
                  flush=True)
            tracking = {"tracking_uri": meta["tracking_uri"], "experiment_id": meta["experiment_id"],
                        "parent_run_id": meta["parent_run_id"], "run_name": f"{meta['name']}/stage1-{key}",
                        "extra_params": {"tune_role": "stage1", "tune_stage1_key": key, "tune_sweep": meta["name"]}}
            show = None if quiet else (lambda rec: print("  stage 1: " + format_round(rec), flush=True))
            launch(prepare(make_config(None, values)), tracking, on_round=show)
        finally:
            lock.release()
        if not stage1_ready(cache):
            raise RuntimeError(f"stage 1 for key {key} ended without writing {cache}")


# --------------------------------------------------------------------------------------------------
# The trial: one experiment inside the trial's placement group
# --------------------------------------------------------------------------------------------------
def run_trial(config: dict, ctx: dict) -> None:
    from ray import tune
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.launch import launch
    from actors.resources import ActorResources
    from rayfl.experiment import prepare
    from rayfl.tracking import numeric

    trial_id = tune.get_context().get_trial_id()
    values = {k: (dict(v) if k == "params" else v) for k, v in ctx["base"].items()}
    for key, value in config.items():
        if key in FIELDS:
            values[key] = value
        else:
            values.setdefault("params", {})[key] = value
    algo = values["algo"]
    lock = None
    if ctx.get("stage1_root"):
        cache = os.path.join(ctx["stage1_root"], stage1_key(values, algo))
        values["params"]["stage1_cache"] = cache
        lock = Stage1Lock(cache)
    cfg = make_config(None, values)
    prepared = prepare(cfg)

    pg = get_current_placement_group()
    bundles = pg.bundle_specs
    n_actors = len(bundles) - 2
    actor = bundles[2]
    resources = ActorResources(float(actor.get("CPU", 0.0)), float(actor.get("GPU", 0.0)))
    pin = lambda i: {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}  # noqa: E731
    swept = {k: config[k] for k in ctx["swept"] if k in config}
    label = " ".join(f"{k}={v}" for k, v in swept.items())
    tracking = {"tracking_uri": ctx["tracking_uri"], "experiment_id": ctx["experiment_id"],
                "parent_run_id": ctx["parent_run_id"], "run_name": f"{ctx['name']}/{trial_id} {label}".strip(),
                "extra_params": {"tune_role": "trial", "tune_trial_id": trial_id, "tune_sweep": ctx["name"],
                                 "tune_swept": ",".join(ctx["swept"]), "tune_bundles": json.dumps(bundles)}}
    metric = ctx["metric"]
    state = {"metric": None, "held": None}

    def on_round(rec: dict) -> None:
        m = numeric(rec["metrics"])
        if metric in m:
            state["metric"] = m[metric]
        elif state["metric"] is not None:  # a round without evaluation carries the last value forward
            m[metric] = state["metric"]
        result = {**m, "round": rec["step"] + 1, "total_rounds": rec["total"], "stage": rec["stage"],
                  "evaluated": int("eval_seconds" in m)}
        if rec["step"] + 1 >= rec["total"]:
            state["held"] = result  # the final report waits until MLflow is done (ASHA may stop us there)
            return
        tune.report(result)

    owner = False
    if lock is not None:
        owner = lock.acquire(lambda: stage1_ready(lock.cache_dir))
    t0 = time.time()
    try:
        out = launch(prepared, tracking, checkpoint_dir=os.path.join(ctx["sweep_dir"], "trials", trial_id),
                     on_round=on_round, resources=resources, driver_options=pin(1),
                     actor_options=[pin(2 + i) for i in range(n_actors)])
    finally:
        if lock is not None:
            lock.release()
    final = state["held"] or {k: v for k, v in numeric(out["final"]).items()}
    final.update({"mlflow_run_id": out["run_id"], "trial_seconds": time.time() - t0,
                  "stage1_owner": int(owner), "pg_id": pg.id.hex(), "trial_start": t0, "trial_end": time.time(),
                  "bundle_cpus": bundle_total(bundles).get("CPU", 0.0)})
    tune.report(final)


# --------------------------------------------------------------------------------------------------
# Console progress
# --------------------------------------------------------------------------------------------------
def _progress_callback(metric: str, swept: list[str], quiet: bool):
    from ray import tune

    class Progress(tune.Callback):
        def _label(self, trial) -> str:
            return " ".join(f"{k}={trial.config.get(k)}" for k in swept)

        def on_trial_start(self, iteration, trials, trial, **info):
            print(f"trial {trial.trial_id} started: {self._label(trial)}", flush=True)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if quiet:
                return
            value = result.get(metric)
            shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
            print(f"trial {trial.trial_id} round {result.get('round', '?')}/{result.get('total_rounds', '?')} "
                  f"[{result.get('stage', '')}] {metric} {shown}", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):
            done = 1 + sum(t.status in ("TERMINATED", "ERROR") for t in trials if t is not trial)
            print(f"trial {trial.trial_id} done ({done}/{len(trials)} finished): {self._label(trial)}", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"trial {trial.trial_id} FAILED: {self._label(trial)} (see {trial.path})", flush=True)

    return Progress()


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------
def add_tune_parser(subparsers, add_config_arguments) -> None:
    p = subparsers.add_parser(
        "tune", help="sweep an algorithm's hyperparameters with Ray Tune",
        description="A Ray Tune sweep over tune_spaces/<algo>.yaml (or --space FILE); flags fix the rest of the "
                    "experiment as in `rayfl run`. Every trial is one experiment and one MLflow child run under "
                    "the sweep's parent run.")
    add_config_arguments(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--space", metavar="FILE", help="search space YAML (default: tune_spaces/<algo>.yaml)")
    g.add_argument("--search", choices=SEARCHES, default="grid",
                   help="grid: every grid point (x --num-samples draws of the random keys); random: --num-samples "
                        "draws (grid lists become choices); optuna: model-based, needs `pip install optuna` "
                        "(runs offline)")
    g.add_argument("--num-samples", type=int, default=None, metavar="N",
                   help="grid: repeats of the grid (default 1); random/optuna: trials (default 10)")
    g.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                   help="trials at once; each gets cluster/N of the CPUs and GPUs (default: as many as fit one "
                        "torch thread per client actor)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default="fifo",
                   help="asha: stop poor trials early on the per-round metric")
    g.add_argument("--grace-period", type=int, default=None, metavar="ROUNDS",
                   help="ASHA: rounds before a trial may be stopped (default: rounds/4, at least 1)")
    g.add_argument("--metric", default=None,
                   help="metric to optimize (default: val_acc_mean; val_loss_mean for regression); never a test metric")
    g.add_argument("--mode", choices=("max", "min"), default=None, help="default: min for losses, else max")
    g.add_argument("--name", help="sweep name (default: <algo>-sweep-<time>)")
    g.add_argument("--storage-path", metavar="DIR",
                   help="where Tune keeps the sweep (default: <out-dir>/tune); shared storage on multi-node clusters")
    g.add_argument("--resume", metavar="DIR", help="go on with an interrupted sweep (its directory)")
    g.add_argument("--no-stage1-reuse", action="store_true",
                   help="PersFL: recompute stage 1 in every trial instead of sharing it across (lam, T)")
    g.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance)")
    g.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    p.set_defaults(handler=cmd_tune)


def _arg_values(args) -> tuple[dict, dict, dict]:
    from rayfl.cli import _parse_scalar

    file_values = read_yaml(args.config) if args.config else {}
    flag_values = {k: v for k, v in vars(args).items() if k in FIELDS and k != "params"}
    flag_params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param {item!r}: expected KEY=VALUE")
        flag_params[key.strip()] = _parse_scalar(value.strip())
    return file_values, flag_values, flag_params


def _default_metric(task: str, metric: str | None, mode: str | None) -> tuple[str, str]:
    metric = metric or ("val_loss_mean" if task == "regression" else "val_acc_mean")
    if metric.startswith("test_") or metric.startswith("final_test"):
        raise UserError(f"--metric {metric}: hyperparameters are selected on validation, never on test "
                        f"(use val_acc_mean, val_loss_mean, ...)")
    return metric, mode or ("min" if "loss" in metric else "max")


def _search_space(plan: Plan, search: str) -> dict:
    from ray import tune

    space: dict[str, Any] = {}
    for key, values in plan.space.grid.items():
        space[key] = tune.grid_search(values) if search == "grid" else tune.choice(values)
    for key, (kind, args) in plan.space.random.items():
        if kind == "choice":
            space[key] = tune.choice(list(args))
        elif kind == "randint":
            space[key] = tune.randint(int(args[0]), int(args[1]) + 1)
        elif kind == "quniform":
            space[key] = tune.quniform(*args)
        else:
            space[key] = getattr(tune, kind)(*args)
    return space


def _search_alg(search: str, seed: int, max_concurrent: int, metric: str, mode: str):
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise UserError("--search optuna: optuna is not installed (`pip install optuna`; it then runs "
                            "offline). Without it: --search grid or --search random") from None
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=seed), max_concurrent=max_concurrent)
    return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)


def _scheduler(kind: str, metric: str, mode: str, grace: int):
    if kind == "fifo":
        return None
    from ray.tune.schedulers import ASHAScheduler

    # max_t only caps: every trial ends by itself after its last round; rungs at grace * 4^k rounds.
    return ASHAScheduler(time_attr="training_iteration", max_t=100_000,
                         grace_period=grace, reduction_factor=4)


def _parent_run(meta: dict):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(meta["tracking_uri"])
    return MlflowClient(meta["tracking_uri"])


def cmd_tune(args) -> int:
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Ctrl-C reaches us as KeyboardInterrupt (Tune's own handler would end fit() as if the sweep were done);
    # Tune has saved its state by then, and --resume goes on from it.
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")
    if args.resume:
        meta = _load_meta(args.resume)
    else:
        meta = _new_sweep(args)
    import ray

    started = not ray.is_initialized()
    if started:
        from rayfl.cli import init_ray

        init_ray(args.address)
    try:
        return _run(meta, args, resume=bool(args.resume))
    finally:
        if started:
            ray.shutdown()


def _load_meta(sweep_dir: str) -> dict:
    path = os.path.join(sweep_dir, SWEEP_FILE)
    if not os.path.isfile(path):
        raise UserError(f"--resume {sweep_dir!r}: no {SWEEP_FILE} there (not a rayfl sweep directory)")
    with open(path) as f:
        meta = json.load(f)
    meta["sweep_dir"] = os.path.abspath(sweep_dir)
    return meta


def _new_sweep(args) -> dict:
    """Everything decided and checked before Ray starts: values, space, metric, resources, MLflow parent."""
    from rayfl.experiment import prepare
    from rayfl.tracking import ensure_experiment, resolve_tracking_uri

    file_values, flag_values, flag_params = _arg_values(args)
    algo = flag_values.get("algo") or file_values.get("algo")
    space_path = args.space or find_space_file(algo or FIELDS["algo"].default)
    space = load_space(space_path)
    plan = plan_sweep(space, file_values, flag_values, flag_params)
    n_grid = validate_space(plan)
    for note in plan.notes:
        print(f"rayfl tune: note: {note}", flush=True)
    if plan.base.get("data_root"):  # trials run in their own directories: relative paths would break there
        plan.base["data_root"] = os.path.abspath(os.path.expanduser(plan.base["data_root"]))
    base_cfg = plan.config({})
    prepared = prepare(base_cfg)  # data errors (a missing data root, ...) before any trial; gives the task
    metric, mode = _default_metric(prepared.info.task, args.metric, args.mode)
    search = args.search
    num_samples = args.num_samples or (1 if search == "grid" else 10)
    if num_samples < 1:
        raise UserError(f"--num-samples {num_samples}: must be >= 1")
    n_trials = n_grid * num_samples if search == "grid" else num_samples
    if search == "optuna":
        _search_alg("optuna", 0, 1, metric, mode)  # fails here, before anything starts, if optuna is missing
    name = args.name or f"{plan.algo}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = os.path.abspath(args.storage_path or os.path.join(base_cfg.out_dir, "tune"))
    sweep_dir = os.path.join(storage, name)
    if os.path.exists(os.path.join(sweep_dir, SWEEP_FILE)):
        raise UserError(f"sweep {sweep_dir} exists; resume it with --resume {sweep_dir}, or pick another --name")
    uri = resolve_tracking_uri(base_cfg.tracking_uri)
    reuse = plan.algo in STAGE1_FREE and "stage1_cache" in plan.knobs and not args.no_stage1_reuse
    stage1_root = None
    if reuse:
        stage1_root = plan.base["params"].get("stage1_cache") or os.path.join(sweep_dir, "stage1")
        stage1_root = os.path.abspath(stage1_root)
    return {"name": name, "storage": storage, "sweep_dir": sweep_dir, "algo": plan.algo, "base": plan.base,
            "space": plan.space.to_dict(), "space_path": os.path.abspath(space_path), "swept": plan.space.swept(),
            "knobs": plan.knobs, "metric": metric, "mode": mode, "search": search, "num_samples": num_samples,
            "n_trials": n_trials, "max_concurrent": args.max_concurrent, "scheduler": args.scheduler,
            "grace_period": args.grace_period or max(1, base_cfg.rounds // 4), "seed": base_cfg.seed,
            "tracking_uri": uri, "experiment": base_cfg.experiment,
            "experiment_id": ensure_experiment(uri, base_cfg.experiment), "stage1_root": stage1_root,
            "parent_run_id": None}


def _plan_from_meta(meta: dict) -> Plan:
    sp = meta["space"]
    space = Space(meta["space_path"], fixed=sp["fixed"], grid=sp["grid"],
                  random={k: next(iter(v.items())) for k, v in sp["random"].items()})
    return Plan(meta["algo"], meta["base"], space, meta["knobs"])


def _default_concurrency(meta: dict, cluster: dict) -> int:
    from actors.resources import DRIVER_CPUS
    from rayfl.runtime import assign_hosts

    cfg = make_config(None, meta["base"])
    n_actors = len(assign_hosts(cfg.clients, cfg.clients_per_actor))
    per_trial = TRIAL_CPUS + DRIVER_CPUS + n_actors * (cfg.cpus_per_actor or cfg.torch_threads)
    return max(1, min(meta["n_trials"], int(cluster.get("CPU", 1.0) // per_trial)))


def _run(meta: dict, args, resume: bool) -> int:
    import ray
    from mlflow.entities import Param
    from ray import tune

    cluster = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    if not resume:
        meta["max_concurrent"] = meta["max_concurrent"] or _default_concurrency(meta, cluster)
        if meta["max_concurrent"] < 1:
            raise UserError(f"--max-concurrent {meta['max_concurrent']}: must be >= 1")
        meta["share"] = {k: v / meta["max_concurrent"] for k, v in cluster.items()}
    share, plan = meta["share"], _plan_from_meta(meta)
    base_bundles = _bundles_for({}, meta["base"], share)
    need = bundle_total(base_bundles)
    if any(need.get(k, 0.0) > cluster.get(k, 0.0) + 1e-9 for k in need):
        raise UserError(f"one trial needs {need} but the cluster has {cluster}: lower --cpus-per-actor / "
                        f"--gpus-per-actor or raise --clients-per-actor")
    from actors import resources as actor_resources

    per_process = getattr(actor_resources, "ACTOR_MEMORY", 0.5 * 2**30)  # a process that imports torch
    memory = float(ray.cluster_resources().get("memory", 0.0))
    processes = meta["max_concurrent"] * len(base_bundles)  # trial, driver and client actors, all with torch
    if memory and processes * per_process > memory:
        fit = max(1, int(memory // (per_process * len(base_bundles))))
        raise UserError(f"{meta['max_concurrent']} trials at once x {len(base_bundles)} processes each need about "
                        f"{processes * per_process / 2**30:.0f} GiB, the cluster offers {memory / 2**30:.0f} GiB: "
                        f"--max-concurrent {fit} (or raise --clients-per-actor)")
    client = _parent_run(meta)
    if not resume:
        parent = client.create_run(meta["experiment_id"], run_name=meta["name"],
                                   tags={"rayfl.sweep": meta["name"], "rayfl.kind": "sweep"})
        meta["parent_run_id"] = parent.info.run_id
        params = {"algo": meta["algo"], "search": meta["search"], "scheduler": meta["scheduler"],
                  "metric": meta["metric"], "mode": meta["mode"], "num_samples": meta["num_samples"],
                  "n_trials": meta["n_trials"], "max_concurrent": meta["max_concurrent"],
                  "swept": ",".join(meta["swept"]), "space_file": meta["space_path"],
                  "trial_bundles": json.dumps(base_bundles), "stage1_reuse": bool(meta["stage1_root"])}
        client.log_batch(meta["parent_run_id"], params=[Param(k, str(v)) for k, v in params.items()])
        client.log_text(meta["parent_run_id"], yaml.safe_dump(meta["space"], sort_keys=False), "space.yaml")
        client.log_text(meta["parent_run_id"], yaml.safe_dump(meta["base"], sort_keys=False), "base_config.yaml")
        os.makedirs(meta["sweep_dir"], exist_ok=True)
        with open(os.path.join(meta["sweep_dir"], SWEEP_FILE), "w") as f:
            json.dump(meta, f, indent=1, default=str)
    else:
        client.update_run(meta["parent_run_id"], status="RUNNING")
    print(f"rayfl tune: {meta['algo']}, {meta['n_trials']} trial(s) over {', '.join(meta['swept']) or 'nothing'} "
          f"({meta['search']}, {meta['scheduler']}), {meta['max_concurrent']} at once, each "
          f"{bundle_total(base_bundles)} in {len(base_bundles)} bundles; optimizing {meta['metric']} ({meta['mode']})",
          flush=True)
    print(f"rayfl tune: sweep directory {meta['sweep_dir']} (resume with --resume {meta['sweep_dir']}); "
          f"MLflow parent run {meta['parent_run_id']}", flush=True)

    ctx = {k: meta[k] for k in ("base", "name", "metric", "swept", "tracking_uri", "experiment_id",
                                 "parent_run_id", "stage1_root", "sweep_dir")}
    trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx),
                                    functools.partial(_pg_factory, base=meta["base"], share=share))
    progress = _progress_callback(meta["metric"], meta["swept"], args.quiet)
    run_config = tune.RunConfig(name=meta["name"], storage_path=meta["storage"], verbose=0, callbacks=[progress],
                                failure_config=tune.FailureConfig(max_failures=0))
    status = "FAILED"
    try:
        if meta["stage1_root"]:
            warm_stage1(meta, plan, args.quiet)
        if resume:
            tuner = tune.Tuner.restore(meta["sweep_dir"], trainable, resume_unfinished=True, restart_errored=True,
                                       param_space=_search_space(plan, meta["search"]))
        else:
            tuner = tune.Tuner(
                trainable, param_space=_search_space(plan, meta["search"]),
                tune_config=tune.TuneConfig(
                    metric=meta["metric"], mode=meta["mode"],
                    num_samples=meta["num_samples"],
                    search_alg=_search_alg(meta["search"], meta["seed"], meta["max_concurrent"], meta["metric"],
                                           meta["mode"]),
                    scheduler=_scheduler(meta["scheduler"], meta["metric"], meta["mode"], meta["grace_period"]),
                    max_concurrent_trials=meta["max_concurrent"]),
                run_config=run_config)
        results = tuner.fit()
        code = _finish(meta, results, client)
        status = "FINISHED" if code == 0 else "FAILED"
        return code
    except KeyboardInterrupt:
        status = "KILLED"
        print(f"rayfl tune: interrupted; go on with: rayfl tune --resume {meta['sweep_dir']}", file=sys.stderr)
        return 130
    finally:
        _close_children(client, meta)
        client.set_terminated(meta["parent_run_id"], status)


def _close_children(client, meta: dict) -> None:
    """Child runs of trials the scheduler stopped early end as FAILED (their actors went with the trial's
    placement group) and those of an interrupted sweep stay RUNNING: mark both KILLED, and say why."""
    try:
        runs = client.search_runs([meta["experiment_id"]],
                                  filter_string=f"tags.mlflow.parentRunId = '{meta['parent_run_id']}'",
                                  max_results=10_000)
    except Exception:  # noqa: BLE001 - tidying must not hide the real outcome
        return
    stopped = set(meta.get("stopped_trials", ()))
    for run in runs:
        trial = run.data.params.get("tune_trial_id")
        if trial in stopped and run.info.status in ("FAILED", "RUNNING"):
            client.set_tag(run.info.run_id, "rayfl.stopped", f"early, by the {meta['scheduler']} scheduler")
            client.set_terminated(run.info.run_id, "KILLED")
        elif run.info.status == "RUNNING":
            client.set_tag(run.info.run_id, "rayfl.stopped", "sweep interrupted (see --resume)")
            client.set_terminated(run.info.run_id, "KILLED")


def results_table(results, meta: dict):
    """One row per trial: status, swept values, rounds done, the last reported metrics, its MLflow run."""
    import pandas as pd

    rows = []
    metric = meta["metric"]
    for r in results:
        m = r.metrics or {}
        row = {"trial": m.get("trial_id") or os.path.basename(str(r.path))}
        row.update({k: (r.config or {}).get(k) for k in meta["swept"]})
        row["status"] = "ERROR" if r.error else ("DONE" if m.get("mlflow_run_id") else "STOPPED")
        row["rounds"] = m.get("round")
        for key in (metric, "val_acc_mean", "val_loss_mean", "test_acc_mean", "test_acc_std", "test_loss_mean"):
            if key in m and key not in row:
                row[key] = m[key]
        row["seconds"] = m.get("trial_seconds", m.get("time_total_s"))
        row["mlflow_run_id"] = m.get("mlflow_run_id")
        rows.append(row)
    df = pd.DataFrame(rows)
    if metric in df:
        df = df.sort_values(metric, ascending=meta["mode"] == "min", na_position="last")
    return df.reset_index(drop=True)


def _finish(meta: dict, results, client) -> int:
    import pandas as pd

    from rayfl.cli import summary_table
    from rayfl.plots import metric_vs_knob

    df = results_table(results, meta)
    meta["stopped_trials"] = list(df.trial[df.status == "STOPPED"]) if len(df) else []
    run_id, metric = meta["parent_run_id"], meta["metric"]
    path = os.path.join(meta["sweep_dir"], "results.csv")
    df.to_csv(path, index=False)
    client.log_artifact(run_id, path, "results")
    if metric in df:
        for knob in meta["swept"]:
            sub = df[[knob, metric]].dropna()
            if len(sub):
                if not all(isinstance(v, (int, float)) for v in sub[knob]):
                    sub = sub.assign(**{knob: sub[knob].map(str)})
                client.log_figure(run_id, metric_vs_knob(sub, knob, metric), f"plots/{metric}_vs_{knob}.png")
    errors = int(sum(1 for r in results if r.error))
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print("\nsweep results (" + ("best first" if metric in df else "no trial reported the metric") + "):")
        print(df.drop(columns=["mlflow_run_id"]).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    try:
        best = results.get_best_result(metric=metric, mode=meta["mode"], scope="last")
    except RuntimeError:
        best = None
    if best is None or not best.metrics or metric not in best.metrics:
        print(f"\nrayfl tune: no trial reported {metric}; {errors} trial(s) failed", file=sys.stderr)
        return 1
    chosen = {k: best.config.get(k) for k in meta["swept"]}
    client.log_dict(run_id, {"best": chosen, metric: best.metrics[metric],
                             "mlflow_run_id": best.metrics.get("mlflow_run_id")}, "best.json")
    client.log_metric(run_id, f"best_{metric}", float(best.metrics[metric]))
    for k, v in chosen.items():
        client.set_tag(run_id, f"best.{k}", str(v))
    print(f"\nbest ({metric} {best.metrics[metric]:.4f}, final round): "
          + ", ".join(f"{k}={v}" for k, v in chosen.items()))
    print(summary_table(best.metrics))
    print(f"\nMLflow: parent run {run_id} in experiment {meta['experiment']!r} at {meta['tracking_uri']}, "
          f"{len(df)} child run(s)")
    print(f"look at it: mlflow ui --backend-store-uri {meta['tracking_uri']}   (then open http://127.0.0.1:5000)")
    if errors:
        print(f"rayfl tune: {errors} trial(s) failed; see {meta['sweep_dir']}", file=sys.stderr)
    return 0
