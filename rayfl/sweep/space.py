"""Space files (``tune_spaces/<algo>.yaml``): ``fixed`` values, ``grid`` lists and ``random``
distributions over Config fields and algorithm knobs. :func:`load_space` reads one and
:func:`validate_space` builds every grid point's Config (and every corner of the random ranges) and runs
``Config.check()`` on it, so a bad key or value is one line naming the file and key, before any trial.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any


from rayfl.config import FIELDS, UserError, load_yaml, make_config, shown
from rayfl.specs import MAX_TRIALS  # noqa: F401 - the sweep's bound, re-exported
from rayfl.user_input import same_value

SECTIONS = ("fixed", "grid", "random")
# name -> number of arguments (None: a list of values)
DISTRIBUTIONS = {"uniform": 2, "loguniform": 2, "quniform": 3, "randint": 2, "choice": None}
# Config fields a space may not set: they name where things go, not what runs.
NOT_IN_SPACE = {"params", "run_name", "experiment", "tracking_uri", "out_dir"}


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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the rayfl package (this is rayfl/sweep/)
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
    data = load_yaml(path, "space file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: must hold a mapping with sections {', '.join(SECTIONS)}")
    for section in data:
        if section not in SECTIONS:
            from rayfl.config import did_you_mean

            raise UserError(f"{path}: unknown section {section!r}{did_you_mean(section, SECTIONS)}; allowed: "
                            f"{', '.join(SECTIONS)}")
        if not isinstance(data[section] or {}, dict):
            raise UserError(f"{path}: {section}: must be a mapping of key: value")
    space = Space(path, fixed=dict(data.get("fixed") or {}))
    seen = {k: "fixed" for k in space.fixed}
    for key, values in (data.get("grid") or {}).items():
        if key in seen:
            raise UserError(f"{path}: grid.{key}: already set in {seen[key]}")
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: grid.{key}: must be a non-empty list of values, e.g. [0.1, 0.5]")
        if len(set(map(same_value, values))) != len(values):
            raise UserError(f"{path}: grid.{key}: repeated values in {shown(values)} (1 and 1.0 are one value)")
        space.grid[key] = values
        seen[key] = "grid"
    if space.n_grid() > MAX_TRIALS:  # before any point is built
        raise UserError(f"{path}: grid: {space.n_grid():,} points; a sweep runs at most {MAX_TRIALS:,} trials")
    for key, spec in (data.get("random") or {}).items():
        if key in seen:
            raise UserError(f"{path}: random.{key}: already set in {seen[key]}")
        space.random[key] = _distribution(path, key, spec)
        seen[key] = "random"
    if not space.swept():
        raise UserError(f"{path}: sweeps nothing (no grid: or random: key); a single run is rayfl run")
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
    if not all(math.isfinite(a) for a in args):
        raise UserError(f"{where}: {kind} bounds must be finite numbers, got {args!r}")
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
        return trial_values(self.base, sample)

    def config(self, sample: dict):
        return make_config(None, self.values(sample))


def trial_values(base: dict, sample: dict) -> dict:
    """The Config values of one trial: ``base`` with the sampled keys put where they belong (config keys at
    the top, algorithm knobs under ``params``)."""
    out = {k: (dict(v) if k == "params" else v) for k, v in base.items()}
    out.setdefault("params", {})
    for key, value in sample.items():
        if key in FIELDS:
            out[key] = value
        else:
            out["params"][key] = value
    return out


def _algo_knobs(algo: str) -> list[str]:
    from rayfl.algorithms import get_algorithm

    try:
        return get_algorithm(algo).param_names()
    except KeyError as e:
        raise UserError(str(e.args[0])) from None


def _implies(algo: str) -> dict:
    from rayfl.algorithms import get_algorithm

    return dict(get_algorithm(algo).implies)


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
                from rayfl.config import did_you_mean

                raise UserError(f"{path}: {section}.{key}: unknown key{did_you_mean(key, [*FIELDS, *knobs])}: neither "
                                f"a config field nor a knob of {algo!r} (its knobs: {', '.join(knobs) or 'none'})")
    base: dict[str, Any] = {k: v for k, v in file_values.items() if k != "params"}
    params = dict(file_values.get("params") or {})
    for key, value in space.fixed.items():
        if key in FIELDS:
            base[key] = value
        else:
            params[key] = value
    base.update(flag_values)
    # a knob the space sets that only acts when others are so (the algorithm declares it: Algorithm.implies)
    for key, implied in _implies(algo).items():
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
