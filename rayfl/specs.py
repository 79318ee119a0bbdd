"""What ``run``, ``tune`` and ``compare`` are asked to do, typed, whichever door a request comes in by (the
``rayfl`` command's flags or the Python API's keywords).

- :class:`SweepOptions` and :class:`CompareOptions`: a sweep's and a comparison's own settings, each with its
  default and its help written once here; ``rayfl tune`` / ``rayfl compare`` build their flags from these fields
  (:func:`rayfl.flags.add_options`) and :func:`rayfl.tune` / :func:`rayfl.compare` take their defaults from them;
- :class:`RunSpec`, :class:`SweepSpec`, :class:`CompareSpec`: a whole request (the experiment's config keys and
  knobs, the options, where it runs, what started it), checked by one method whichever door it came in by;
- :class:`TrackingSpec`: the tracking store and experiment a request logs to;
- :func:`check_resume`: the rules of ``--resume`` / ``resume=``, for a run and a sweep.

Nothing here starts Ray or imports MLflow: :class:`rayfl.session.Session` does, for all three.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from rayfl.config import Config, UserError, shown

SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("fifo", "asha")
MODES = ("max", "min")
RUNTIMES = ("ray", "local")
MAX_TRIALS = 10_000  # trials of one sweep (grid points x samples): Tune builds each before the first runs


def option(default: Any, help: str, **flag: Any):
    """A field of an options class: its default, its help (``{default}`` in it is replaced by the default) and
    how its flag reads (``metavar``, ``choices`` (or a function giving them), ``type``, ``nargs``;
    ``flag``/``action``/``const`` for a
    switch such as ``--no-stage-reuse`` or ``--local``, ``flag=None`` for an API keyword with no flag;
    ``cli_default``: the flag's 'not given' where the command works the default out later)."""
    return field(default=default, metadata={"help": help, **flag})


def defaults(options: type) -> dict[str, Any]:
    """Each option's default, by name."""
    return {f.name: f.default for f in dataclasses.fields(options)}


@dataclass
class SweepOptions:
    """A sweep's own settings (``rayfl tune --help``'s sweep group, :func:`rayfl.tune`'s keywords)."""

    space: str | dict | None = option(None, "search space YAML (default: tune_spaces/<algo>.yaml)", metavar="FILE")
    search: str = option("grid", "grid: every grid point (x --num-samples draws of the random keys); random: "
                                 "--num-samples draws (grid lists become choices); optuna: model-based, needs "
                                 "`pip install 'rayfl[optuna]'` (runs offline)", choices=SEARCHES)
    num_samples: int | None = option(None, "grid: repeats of the grid (default 1); random/optuna: trials (default 10)",
                                     type=int, metavar="N")
    max_concurrent: int | None = option(None, "trials at once; each gets cluster/N of the CPUs and GPUs (default: as "
                                              "many as fit one torch thread per client actor)", type=int, metavar="N")
    scheduler: str = option("fifo", "asha: stop poor trials early on the per-round metric", choices=SCHEDULERS)
    grace_period: int | None = option(None, "ASHA: rounds before a trial may be stopped (default: rounds/4, at least 1)",
                                      type=int, metavar="ROUNDS")
    metric: str | None = option(None, "metric to optimize (default: val_acc_mean; val_loss_mean for regression); "
                                      "never a test metric")
    mode: str | None = option(None, "default: min for losses, else max", choices=MODES)
    name: str | None = option(None, "sweep name (default: <algo>-sweep-<time>)")
    storage_path: str | None = option(None, "where Tune keeps the sweep (default: <out-dir>/tune); shared storage on "
                                            "multi-node clusters", metavar="DIR")
    stage_reuse: bool = option(True, "compute every stage in every trial (default: trials that agree up to a stage "
                                     "share it, e.g. PersFL's FedAvg stage across (lam, T); see --stage-cache)",
                               flag="--no-stage-reuse", action="store_false")


@dataclass
class CompareOptions:
    """A comparison's own settings (``rayfl compare --help``'s comparison group, :func:`rayfl.compare`'s
    keywords)."""

    algos: list[str] | None = option(None, "algorithms to compare (default: the preset's)", metavar="A,B,...")
    seeds: tuple[int, ...] = option((0, 1, 2), "seeds (default: {default}, or --seed)", type=int, nargs="+",
                                    metavar="S", cli_default=None)
    preset: str | None = option(None, "a paper's setting; flags override it", choices=lambda: preset_names())
    max_concurrent: int | None = option(None, "experiments at once (default: one per CPU)", type=int, metavar="N")
    runtime: str = option("ray", "run in this process without Ray, one at a time", flag="--local",
                          action="store_const", const="local")
    name: str | None = option(None, "MLflow parent run name")
    # the API's alone (flag=None): the command prints these lines always, and --quiet drops its round lines
    progress: Any = option(True, "True: print what will run, 'k/N done' with the time left as each experiment "
                                 "ends, and where MLflow shows the result; False: nothing; a callable gets each line",
                           flag=None)


def preset_names() -> list[str]:
    from rayfl.comparison.presets import PRESETS

    return sorted(PRESETS)


@dataclass
class ViewOptions:
    """Where a command's printed MLflow addresses point (``rayfl run``, ``tune`` and ``compare``'s ``--ui-port``)."""

    ui_port: int | None = option(None, "port of the MLflow UI that the printed addresses point at: the --port you "
                                       "start `mlflow ui` with (default: 5000, its own, for a local store; a tracking "
                                       "server's own address)", metavar="PORT")


def check_ui_port(value: Any, style: str = "flag") -> int | None:
    """The UI's port: an integer from 1 to 65535 (None: the default)."""
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not (isinstance(value, int) or text.isascii() and text.isdigit()) \
            or not 1 <= int(text) <= 65535:
        raise UserError(f"{shown_key('ui_port', style)}={value}: must be an integer port from 1 to 65535 (the one "
                        f"`mlflow ui --port` listens on)")
    return int(text)


SWEEP_DEFAULTS = defaults(SweepOptions)
COMPARE_DEFAULTS = defaults(CompareOptions)


def shown_key(key: str, style: str) -> str:
    """A setting as the user gave it: ``--num-samples`` on the command line (style "flag"), ``num_samples``
    in the API (style "api")."""
    return f"--{key.replace('_', '-')}" if style == "flag" else key


# --------------------------------------------------------------------------------------------------
# --resume / resume=
# --------------------------------------------------------------------------------------------------
_RESUME = {  # (kind, style) -> what else a resume may be given, and what to say when it is given more
    ("run", "flag"): (("--lr",), "a resumed run keeps its saved config; give only --resume DIR (and --address, "
                      "--quiet, or a lower step size: --lr, -p NAME_lr=VALUE)"),
    ("run", "api"): (("lr", "params"), "a resumed run uses its own config.yaml; pass no other settings than a lower "
                     "step size (lr=, params={'NAME_lr': ...})"),
    ("sweep", "flag"): (("--tracking-uri", "--stage-cache"), "a resumed sweep keeps its saved settings; give only "
                        "--resume DIR (and --tracking-uri, --stage-cache, --address, --quiet)"),
    ("sweep", "api"): (("tracking_uri", "stage_cache"), "a resumed sweep uses its own settings; pass no others (but "
                       "tracking_uri, stage_cache)"),
}


def check_resume(resume: Any, given: list[str], kind: str, style: str) -> str | None:
    """The rules of ``--resume DIR`` / ``resume=DIR`` for a ``kind`` "run" or "sweep": a path, not empty, with
    no other setting ``given`` (flags, or keyword names) than where a resumed sweep writes; a resumed run or
    sweep keeps what it was started with. The path (None: not a resume)."""
    if resume is None:
        return None
    what = "a run directory" if kind == "run" else "a directory"
    if not isinstance(resume, (str, os.PathLike)):
        raise UserError(f"{shown_key('resume', style)}={shown(resume)}: must be {what} (a path)")
    resume = os.fspath(resume)
    if not resume.strip():
        named = f"--resume {resume!r}" if style == "flag" else f"resume={shown(resume)}"
        raise UserError(f"{named}: empty path; give {'a run' if kind == 'run' else 'a sweep'} directory")
    allowed, rule = _RESUME[(kind, style)]
    extra = [g for g in given if g not in allowed]
    if extra:
        named = f"--resume {resume!r} with {extra[0]}" if style == "flag" else f"resume={shown(resume)}"
        raise UserError(f"{named}: {rule}")
    return resume


# --------------------------------------------------------------------------------------------------
# Where runs are logged
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrackingSpec:
    """The tracking store (its URI resolved: the flag, else $MLFLOW_TRACKING_URI, else a local SQLite file;
    local paths absolute) and the experiment a request's runs are logged to; ``system_metrics_interval``: the
    config key, for the parent runs the session opens (a run's own tracker reads its config)."""

    uri: str
    experiment: str
    system_metrics_interval: float = Config.system_metrics_interval

    @classmethod
    def of(cls, cfg: Config) -> "TrackingSpec":
        from rayfl.tracking import resolve_tracking_uri

        return cls(resolve_tracking_uri(cfg.tracking_uri), cfg.experiment, cfg.system_metrics_interval)

    def for_run(self, run_name: str, *, experiment_id: str | None = None, parent_run_id: str | None = None,
                tags: dict | None = None, extra_params: dict | None = None, partition: dict | None = None,
                selection: str | None = None) -> dict:
        """The settings of one run's tracker (:class:`rayfl.tracking.MlflowTracker`), as the engine takes them
        (``selection``: a sweep trial's selection metric)."""
        out = {"tracking_uri": self.uri, "run_name": run_name, "tags": tags or {}}
        out.update({"experiment_id": experiment_id} if experiment_id else {"experiment": self.experiment})
        if parent_run_id:
            out["parent_run_id"] = parent_run_id
        if extra_params:
            out["extra_params"] = extra_params
        if partition is not None:
            out["partition"] = partition
        if selection:
            out["selection"] = selection
        return out


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    """One experiment: its Config, or (``resume``) a run directory whose own config.yaml and checkpoint it goes
    on from; ``address``: the Ray cluster (None: $RAY_ADDRESS, else a private local instance); ``command``: the
    API call that asked for it (None: this process's command line), for the run's provenance tags; ``keep``: a
    private instance started for it stays up for the next call in this process, and so do its actors (the
    Python API's runs; :func:`rayfl.session.shutdown` ends them)."""

    config: Config | None = None
    resume: str | None = None
    address: str | None = None
    command: str | None = None
    step_sizes: dict = field(default_factory=dict)  # a resume's lower step sizes: {"lr": ..., "params": {...}}
    ui_port: int | None = ViewOptions.ui_port  # where the printed MLflow addresses point (check_ui_port)
    keep: bool = False


@dataclass
class SweepSpec(SweepOptions):
    """A sweep: the experiment (a config file, config keys over it, algorithm knobs), the sweep's options, and
    where it runs. ``call``: the API call that started it (None: the command line; mistakes then name flags)."""

    config: str | None = None  # a YAML file of config keys
    values: dict = field(default_factory=dict)  # config keys given, over the file's
    params: dict = field(default_factory=dict)  # algorithm knobs given, over the file's
    resume: str | None = None  # a sweep directory to go on with
    address: str | None = None
    quiet: bool = False
    call: str | None = None
    ui_port: int | None = ViewOptions.ui_port  # where the printed MLflow addresses point (check_ui_port)

    @property
    def style(self) -> str:
        return "flag" if self.call is None else "api"

    def given(self) -> list[str]:
        """The settings given beside the sweep's options' defaults (config keys, knobs, the config file, then
        the sweep's own), named as the user gave them."""
        style = self.style
        names = [*self.values, *(["param" if style == "flag" else "params"] if self.params else []),
                 *(["config"] if self.config else [])]
        for f in dataclasses.fields(SweepOptions):
            if getattr(self, f.name) != f.default:
                names.append("no_stage_reuse" if f.name == "stage_reuse" and style == "flag" else f.name)
        return [shown_key(n, style) for n in names]

    def check(self) -> None:
        """Every sweep option a value it may take (the command line's flags were read by their types already)."""
        style = self.style
        if self.space is not None and not isinstance(self.space, (str, os.PathLike, dict)):
            raise UserError(f"space={shown(self.space)}: expected a space file path or a dict with fixed / grid / "
                            f"random sections")
        if isinstance(self.space, dict):
            check_plain("space", self.space)
        for key, allowed in (("search", SEARCHES), ("scheduler", SCHEDULERS)):
            if getattr(self, key) not in allowed:
                raise UserError(f"{key}={getattr(self, key)!r}: unknown; allowed: {', '.join(allowed)}")
        if self.mode not in (None, *MODES):
            raise UserError(f"mode={self.mode!r}: allowed: {', '.join(MODES)}")
        for key in ("num_samples", "max_concurrent", "grace_period"):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{shown_key(key, style)}={value!r}: must be an integer >= 1 (leave it out for the "
                                f"default)")
            if key == "num_samples" and value > MAX_TRIALS:
                raise UserError(f"{shown_key(key, style)}={value}: a sweep runs at most {MAX_TRIALS:,} trials")
        if self.name is not None:
            check_name(self.name, shown_key("name", style))
        if self.metric is not None and not isinstance(self.metric, str):
            raise UserError(f"metric={shown(self.metric)}: must be a metric name, e.g. 'val_acc_mean'")
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise UserError(f"storage_path={shown(self.storage_path)}: must be a directory (a path)")
        self.resume = check_resume(self.resume, self.given(), "sweep", style)


def check_name(name: Any, flag: str = "--name") -> None:
    """A sweep's name is its directory's name under the storage path."""
    if not isinstance(name, str) or not name.strip() or "/" in name or "\\" in name or name in (".", "..") \
            or not name.isprintable():
        raise UserError(f"{flag}={name!r}: must be a directory name (no '/'), without control characters, e.g. persfl-lam")


def check_plain(name: str, value: Any) -> None:
    """A value written as YAML (a space given as a dict): only text, numbers, booleans, null, lists and dicts."""
    stack = [value]
    while stack:  # bounded already by check_value
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += list(item)
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            raise UserError(f"{name}: holds {shown(item)}, a {type(item).__name__}; a space holds text, numbers, "
                            f"booleans, lists and dicts")


@dataclass
class CompareSpec(CompareOptions):
    """A comparison: its options, the config keys and knobs every row shares, where it runs and what asked for
    it (``command``), and who sees its rounds and lines (``on_round``, ``say``)."""

    params: dict | None = None
    config: dict = field(default_factory=dict)
    address: str | None = None
    command: str | None = None
    ui_port: int | None = ViewOptions.ui_port  # where the printed MLflow addresses point (check_ui_port)

    def check(self) -> None:
        """The comparison's own options (its rows and seeds are checked as its configs are built)."""
        if self.name is not None and not isinstance(self.name, str):
            raise UserError(f"name={shown(self.name)}: must be a string (the MLflow parent run's name)")
        if self.name is not None and (not self.name.strip() or not self.name.isprintable()):
            raise UserError(f"name={shown(self.name)}: must be a non-empty name without control characters (the "
                            f"MLflow parent run's name)")
        if not isinstance(self.progress, bool) and not callable(self.progress):
            raise UserError(f"progress={shown(self.progress)}: must be True, False or a callable taking each line")
        if self.runtime not in RUNTIMES:
            raise UserError(f"runtime={self.runtime!r}: allowed: {', '.join(RUNTIMES)}")
        if self.runtime == "local" and self.address is not None:
            raise UserError(f"address={shown(self.address)}: a local comparison (--local) runs in this process, on "
                            f"no cluster; give one or the other")
        if self.algos is not None and (isinstance(self.algos, str) or not isinstance(self.algos, (list, tuple))
                                       or not all(isinstance(a, str) for a in self.algos)):
            raise UserError(f"algos={shown(self.algos)}: must be a list of row names, e.g. ['fedavg', 'fedfomo:M=3']")
        if self.params is not None and not (isinstance(self.params, dict)
                                            and all(isinstance(k, str) for k in self.params)):
            raise UserError(f"params={shown(self.params)}: must be a dict of algorithm knobs (name: value)")
        if not isinstance(self.seeds, (list, tuple, range)):
            raise UserError(f"seeds={shown(self.seeds)}: give one or more distinct integer seeds, e.g. [0, 1, 2]")
        if self.max_concurrent is not None and (isinstance(self.max_concurrent, bool)
                                                or not isinstance(self.max_concurrent, int) or self.max_concurrent < 1):
            raise UserError(f"max_concurrent={shown(self.max_concurrent)}: must be an integer >= 1")
