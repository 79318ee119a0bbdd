"""The Python API: :func:`run` one experiment, :func:`tune` a sweep.

The ``rayfl`` command parses its flags into the same typed requests (:mod:`rayfl.specs`) and runs them as this
module does: :func:`run_spec` for a run, :func:`rayfl.sweep.command.run_sweep` for a sweep,
:func:`rayfl.comparison.run.compare_spec` for a comparison; each goes through one :class:`rayfl.session.Session`
(Ray, run directories, the tracking store, parent runs).

Settings are the config keys of ``rayfl run --help`` as keyword arguments (``clients=10``), algorithm
knobs in ``params``; a YAML file or a dict may give a base (``config=``) that keywords override. A mistake
raises :class:`rayfl.UserError` before Ray starts. Ray: the instance this process is already connected to
(left running), else ``address`` / ``$RAY_ADDRESS`` (disconnected at the end), else a private local instance
that :func:`run` starts and keeps up for the next call in this process, with the run's actors (a next run of
the same placement reuses them): :func:`shutdown` ends both, as the interpreter's exit does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from rayfl.config import FIELDS, Config, UserError, check_keys, check_value, make_config, shown
from rayfl.config_help import GROUPS
from rayfl.progress import ConsoleProgress, RoundClock, ui_url
from rayfl.session import Session, check_address, load_run_dir
from rayfl.specs import SWEEP_DEFAULTS, RunSpec, SweepOptions, SweepSpec, TrackingSpec, check_resume

Progress = Callable[[dict], None]


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
HEADLINE = (("mean", "mean"), ("worst", "worst client"), ("bottom10_mean", "bottom 10%"))


def headline_text(final: dict) -> str:
    """``test acc 0.9123 (worst 0.5000, bottom 10% 0.6100)``: the three numbers a run is judged by."""
    kind = "acc" if "test_acc_mean" in final else "loss"
    if f"test_{kind}_mean" not in final:
        return "no test metrics"
    return (f"test {kind} {final[f'test_{kind}_mean']:.4f} (worst {final.get(f'test_{kind}_worst', math.nan):.4f}, "
            f"bottom 10% {final.get(f'test_{kind}_bottom10_mean', math.nan):.4f})")


def result_html(title: str, rows: list[tuple[str, list[float]]], url: str, note: str = "",
                worst_samples: int | None = None, caveat: str | None = None) -> str:
    """A result as Jupyter shows it: a title, a small table (a row of mean / worst client / bottom 10% per
    metric; the test worst client marked † when it rests on fewer than 10 test samples), its caveats, and the
    link to its MLflow run."""
    from html import escape

    from rayfl.metrics import FEW_SAMPLES_MARK, few_samples, few_samples_note

    marked = few_samples(worst_samples)
    head = "".join(f"<th>{escape(h)}</th>" for _, h in HEADLINE)
    body = "".join(f"<tr><th style='text-align:left'>{escape(name)}</th>"
                   + "".join(f"<td>{v:.4f}{FEW_SAMPLES_MARK if marked and k == 1 and name.startswith('test') else ''}"
                             f"</td>" for k, v in enumerate(values)) + "</tr>" for name, values in rows)
    table = f"<table><tr><th></th>{head}</tr>{body}</table>" if rows else ""
    notes = [*([few_samples_note(worst_samples)] if marked and rows else []),
             *([f"Caveat: {caveat}."] if caveat else []), *([note] if note else [])]
    extra = "".join(f"<div>{escape(n)}</div>" for n in notes)
    return (f"<div><b>{escape(title)}</b>{table}{extra}"
            f"<div>MLflow: <a href='{escape(url)}' target='_blank'>{escape(url)}</a></div></div>")


def _headline_rows(final: dict) -> list[tuple[str, list[float]]]:
    return [(f"{split} {kind}", [final.get(f"{split}_{kind}_{s}", math.nan) for s, _ in HEADLINE])
            for split in ("test", "val") for kind in ("acc", "loss")
            if f"{split}_{kind}_mean" in final and (kind == "acc" or "test_acc_mean" not in final)]


@dataclass
class RunResult:
    """One experiment, as :func:`run` returns it.

    ``final``: the final round's summary across clients (a dict; ``round`` names it, from 1, and ``stage``
    its stage); ``history``: a row per round (``round`` from 1, as on the console and in MLflow's steps, and
    ``wall_seconds``); ``clients``: a row per client, its last evaluation first; ``run_id`` / ``mlflow_url``:
    its MLflow run; ``run_dir``: its config and checkpoints; ``config``: the Config that ran; ``caveat``: the
    partition's warning, and ``worst_test_samples`` the test samples the worst client's value rests on (marked
    † below 10), both shown with the numbers."""

    final: dict
    history: Any  # pandas.DataFrame
    clients: Any  # pandas.DataFrame
    run_id: str
    run_dir: str
    tracking_uri: str
    experiment_id: str
    config: Any = None  # rayfl.Config
    tracking_unsent: str | None = None  # the line saying what its tracking server did not get, and how to send it
    worst_test_samples: int | None = None  # the test samples its worst client's value rests on (rayfl.metrics)
    caveat: str | None = None  # the partition's warning (small validation or test splits), or None

    @property
    def mlflow_url(self) -> str:
        """The run's page in the MLflow UI."""
        return ui_url(self.tracking_uri, self.experiment_id, self.run_id)

    def _what(self) -> str:
        cfg = self.config
        what = (f"{cfg.algo} on {cfg.dataset}, {cfg.clients} clients" if cfg is not None
                else f"{len(self.clients)} clients")
        where = f"round {self.final['round']}" if "round" in self.final else "no round"
        return f"{what}, final {where}"

    def __repr__(self) -> str:
        return (f"RunResult({self._what()}: {headline_text(self.final)})\n"
                f"  .history {len(self.history)} rounds, .clients {len(self.clients)} rows; {self.mlflow_url}")

    def _repr_html_(self) -> str:
        return result_html(f"RunResult: {self._what()}", _headline_rows(self.final), self.mlflow_url,
                           f".history: {len(self.history)} rounds; .clients: {len(self.clients)} rows",
                           self.worst_test_samples, self.caveat)


@dataclass
class SweepResult:
    """One sweep, as :func:`tune` returns it.

    ``table``: a row per trial, best (on the validation ``metric``) first; ``best``: the best trial's knobs and
    its ``metric``; ``parent_run_id`` / ``mlflow_url``: the sweep's MLflow parent run (its trials are child
    runs); ``sweep_dir``: Tune's directory, what ``resume=`` takes."""

    table: Any  # pandas.DataFrame
    parent_run_id: str
    sweep_dir: str
    best: dict
    tracking_uri: str
    experiment_id: str
    metric: str = ""
    algo: str = ""

    @property
    def mlflow_url(self) -> str:
        """The sweep's parent run in the MLflow UI."""
        return ui_url(self.tracking_uri, self.experiment_id, self.parent_run_id)

    def _what(self) -> str:
        done = int((self.table["status"] == "DONE").sum()) if "status" in self.table else 0
        knobs = ", ".join(f"{k}={v}" for k, v in self.best.items() if k != self.metric)
        value = self.best.get(self.metric)
        best = f"best {knobs} ({self.metric} {value:.4f})" if value is not None else "no best trial"
        return f"{self.algo} sweep, {len(self.table)} trials ({done} done); {best}"

    def __repr__(self) -> str:
        return f"SweepResult({self._what()})\n  .table {len(self.table)} rows; {self.mlflow_url}"

    def _repr_html_(self) -> str:
        head = result_html(f"SweepResult: {self._what()}", [], self.mlflow_url)
        shown = self.table.drop(columns=[c for c in ("mlflow_run_id",) if c in self.table]).head(5)
        more = f"<div>... {len(self.table) - 5} more rows in .table</div>" if len(self.table) > 5 else ""
        return head + shown.to_html(index=False, float_format=lambda v: f"{v:.4f}", na_rep="", escape=True) + more


class SweepFailed(RuntimeError):
    """No trial of a sweep reported its metric (each trial's error is in the sweep directory)."""


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
def make_run_config(config: str | dict | Config | None = None, **values) -> Config:
    """A Config from a YAML path, a dict or a Config, overridden by keyword values (params merged)."""
    if isinstance(config, Config):
        config = dataclasses.asdict(config)
    if config is not None and not isinstance(config, (str, os.PathLike, dict)):
        raise UserError(f"config={config!r}: expected a YAML file path, a dict or a rayfl Config")
    file = os.fspath(config) if isinstance(config, (str, os.PathLike)) else None
    base = dict(config) if isinstance(config, dict) else {}
    check_keys({**base, **values})
    if base.get("params") is not None and not isinstance(base["params"], dict):
        raise UserError(f"config['params']={shown(base['params'])}: must be a dict of algorithm knobs")
    if "params" in values and not isinstance(values["params"], dict):
        raise UserError(f"params={values['params']!r}: must be a dict of algorithm knobs")
    params = {**(base.pop("params", None) or {}), **(values.pop("params", None) or {})}
    overrides = {**base, **values}
    if params:
        overrides["params"] = params
    return make_config(file, overrides)


def _progress(progress: bool | Progress | None) -> Progress:
    if callable(progress):
        return progress
    if progress:
        return ConsoleProgress()
    return lambda event: None


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------
def run(config: str | dict | Config | None = None, *, resume: str | None = None, address: str | None = None,
        progress: bool | Progress = True, plugins: list[str] | None = None, **values) -> RunResult:
    """Run one experiment and return its :class:`RunResult`.

    ``rayfl.run(algo="fedfomo", dataset="digits", clients=10, rounds=5, params={"M": 3})``;
    ``resume=DIR`` goes on from the last checkpoint of a run directory (its own config.yaml is used, but for
    a lower step size given with it: ``lr=``, ``params={"personal_lr": ...}``);
    ``progress``: True prints lines as ``rayfl run`` does, False nothing, or a callable gets each event
    (see :mod:`rayfl.progress`); ``plugins``: .py files or module names to load first, as ``--plugin``.
    A private local Ray instance it starts stays up for the next call, with the run's actors, which a next run
    of the same placement reuses (:func:`shutdown` ends them)."""
    from rayfl.plugins import as_sources, load_plugins
    from rayfl.provenance import api_call

    for key, value in {"config": config, "resume": resume, **values}.items():
        check_value(key, value)  # bounded before the call is recorded (its repr) or walked
    load_plugins(as_sources(plugins))
    command = api_call("run", {**({"config": config} if config is not None else {}),
                               **({"resume": resume} if resume else {}),
                               **({"plugins": plugins} if plugins else {}), **values})
    given = [*(["config"] if config is not None else []), *values]
    resume = check_resume(resume, given, "run", "api")
    spec = RunSpec(None if resume else make_run_config(config, **values), resume, address, command,
                   step_sizes=values if resume else {}, keep=True)
    return run_spec(spec, progress=_progress(progress))


def run_spec(spec: RunSpec, progress: Progress = lambda e: None) -> RunResult:
    """A :class:`rayfl.specs.RunSpec`, as :func:`run` and ``rayfl run`` ask for it: checks, Ray, the run, the
    result."""
    from rayfl.data.report import PartitionReport
    from rayfl.experiment import prepare
    from rayfl.metrics import worst_client_samples
    from rayfl.provenance import origin
    from rayfl.tracking import client_table, final_summary

    resume = spec.resume
    check_address(spec.address)
    cfg = load_run_dir(resume, spec.step_sizes) if resume else spec.config
    prepared = prepare(cfg)  # every user mistake surfaces here, before Ray starts
    if resume:  # and a checkpoint edited or cut short, against a fresh run of its config
        from rayfl.resume import check_checkpoint

        check_checkpoint(resume, prepared)
    tracking = TrackingSpec.of(cfg)
    with Session(spec.address, tracking, progress, keep=spec.keep) as session:
        if not session.on_cluster:  # a private instance on this machine:
            from rayfl.actors.resources import preflight

            session.check_here(cfg.torch_threads)
            preflight(cfg)  # a request it cannot hold is refused now
            session.check_store()  # and a tracking store its driver could not open
        data = re.sub(r"[^\w.-]+", "_", os.path.basename(cfg.dataset.rstrip("/")))  # npz:/a/b.npz: b.npz
        run_name = cfg.run_name or f"{cfg.algo}-{data}-{cfg.partition}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = os.path.abspath(resume) if resume else session.run_dir(cfg, run_name)
        report = PartitionReport.of(prepared)
        progress({"event": "plan", "cfg": cfg, "prepared": prepared, "run_dir": run_dir, "tracking_uri": tracking.uri,
                  "run_name": run_name, "partition": report, "ui_port": spec.ui_port})
        session.start_ray()
        clock, walls = RoundClock(), {}

        def on_event(event: dict) -> None:
            if event["event"] in ("start", "setup"):
                clock.mark(event["time"])
            progress(event)

        def on_round(rec: dict) -> None:
            walls[rec["step"]] = clock.round(rec)[0]
            progress({"event": "round", **rec})

        # the driver opens the experiment (created if missing) while its client actors start: this process never
        # imports MLflow (1.3 s) nor opens the store (1.3-2.6 s) before Ray starts
        from rayfl.actors.launch import launch

        if session.on_cluster:  # the driver opens the store on the cluster: ask there
            session.check_store_shared()  # a file one machine holds: refused on several
            session.check_store_on_cluster()
        out = launch(prepared, tracking.for_run(run_name, tags=origin(spec.command), partition=report.to_dict()),
                     checkpoint_dir=run_dir, on_round=on_round, on_event=on_event, cluster_may_grow=session.on_cluster,
                     pool=session.pool)
    result = RunResult(final_summary(out["final"]), _history(out["history"], walls),
                       client_table(out["per_client"], prepared.info), out["run_id"], run_dir, tracking.uri,
                       out["experiment_id"], cfg, out.get("tracking_unsent"),
                       worst_client_samples(out["per_client"].values()), report.warning())
    progress({"event": "done", "result": result})
    return result


def shutdown() -> None:
    """End what :func:`run` keeps between calls in this process: the actors of the last run and the private
    local Ray instance it started (a Ray you started, or a cluster's, is left alone). The interpreter's exit
    does the same; the next call starts them again."""
    from rayfl.session import shutdown as end

    end()


def sync(run_dir: str, tracking_uri: str | None = None) -> dict:
    """Send what a run kept in ``run_dir`` for a tracking server that did not answer within its
    ``tracking_wait`` to the same MLflow run (at ``tracking_uri``, default the one the run used), as
    ``rayfl sync`` does; returns the counts sent. A second call sends nothing. A sweep's or a comparison's
    directory syncs each of its runs that kept records: the counts by run directory."""
    from rayfl.tracking.outbox import sync as deliver

    return deliver(run_dir, tracking_uri)


def _history(rows: list[dict], walls: dict[int, float]):
    """A row per round, counted from 1 (as MLflow's steps and the console), with its wall time (the time since
    the round before was reported, evaluation and logging included: the walls add up to the run's time; none
    for rounds run before a resume)."""
    from rayfl.tracking import rounds_table

    df = rounds_table(rows)
    if not df.empty:
        df["wall_seconds"] = (df["round"] - 1).map(walls).astype(float)
    return df


# --------------------------------------------------------------------------------------------------
# tune
# --------------------------------------------------------------------------------------------------
def tune(config: str | dict | Config | None = None, *, space: str | dict | None = SweepOptions.space,
         search: str = SweepOptions.search, num_samples: int | None = SweepOptions.num_samples,
         max_concurrent: int | None = SweepOptions.max_concurrent, scheduler: str = SweepOptions.scheduler,
         grace_period: int | None = SweepOptions.grace_period, metric: str | None = SweepOptions.metric,
         mode: str | None = SweepOptions.mode, name: str | None = SweepOptions.name,
         storage_path: str | None = SweepOptions.storage_path, resume: str | None = None,
         stage_reuse: bool = SweepOptions.stage_reuse, address: str | None = None, progress: bool = True,
         plugins: list[str] | None = None, **values) -> SweepResult:
    """Sweep an algorithm's knobs with Ray Tune, as ``rayfl tune`` does; returns a :class:`SweepResult`.

    ``space``: a space file, a dict with ``fixed`` / ``grid`` / ``random`` sections (as in
    ``tune_spaces/*.yaml``), or None for ``tune_spaces/<algo>.yaml``. The other sweep arguments are those of
    ``rayfl tune --help`` (:class:`rayfl.specs.SweepOptions`, their defaults); config keys and ``params`` fix
    the rest of the experiment; ``plugins``: .py files or module names to load first, as ``--plugin``."""
    import pandas as pd

    from rayfl.plugins import as_sources, load_plugins
    from rayfl.provenance import api_call
    from rayfl.sweep.command import best_of, run_sweep

    load_plugins(as_sources(plugins))
    options = {"space": space, "search": search, "num_samples": num_samples, "max_concurrent": max_concurrent,
               "scheduler": scheduler, "grace_period": grace_period, "metric": metric, "mode": mode, "name": name,
               "storage_path": storage_path, "stage_reuse": stage_reuse}
    for key, value in {"config": config, **options, "resume": resume, **values}.items():
        check_value(key, value)  # bounded before the call is recorded (its repr) or walked
    call = api_call("tune", {**({"config": config} if config is not None else {}),
                             **{k: v for k, v in options.items() if v != SWEEP_DEFAULTS[k]},
                             **({"resume": resume} if resume is not None else {}), **values})
    if config is not None and not isinstance(config, (str, os.PathLike, dict, Config)):
        raise UserError(f"config={shown(config)}: expected a YAML file path, a dict or a rayfl Config")
    if isinstance(config, dict) and config.get("params") is not None and not isinstance(config["params"], dict):
        raise UserError(f"config['params']={shown(config['params'])}: must be a dict of algorithm knobs")
    check_keys(values)
    params = values.pop("params", None) or {}
    if not isinstance(params, dict):
        raise UserError(f"params={params!r}: must be a dict of algorithm knobs")
    file = None
    if isinstance(config, Config):
        config = dataclasses.asdict(config)
    if isinstance(config, dict):
        params = {**(config.get("params") or {}), **params}
        values = {**{k: v for k, v in config.items() if k != "params"}, **values}
    elif config is not None:
        file = os.fspath(config)
    spec = SweepSpec(**options, config=file, values=values, params=params, resume=resume, address=address,
                     quiet=not progress, call=call)
    meta, code = run_sweep(spec)
    if code == 130:
        raise KeyboardInterrupt
    path = os.path.join(meta["sweep_dir"], "results.csv")
    table = pd.read_csv(path) if os.path.isfile(path) else pd.DataFrame()
    if code != 0:
        raise SweepFailed(f"sweep {meta['name']}: no trial reported {meta['metric']}; see {meta['sweep_dir']}")
    return SweepResult(table, meta["parent_run_id"], meta["sweep_dir"], best_of(table, meta),
                       meta["tracking_uri"], meta["experiment_id"], meta["metric"], meta["algo"])


# --------------------------------------------------------------------------------------------------
# help(rayfl.run): the config keys, from the Config itself
# --------------------------------------------------------------------------------------------------
def config_keys_doc() -> str:
    """Every config key with its default (from :class:`rayfl.Config`) and its ``rayfl run --help`` text, in
    the help screen's groups: generated, so that it cannot drift from the config."""
    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    lines = ["", "    Config keys (keyword arguments), with their defaults:", "",
             f"        params = {default(FIELDS['params'])!r}: the algorithm's knobs, e.g. {{'M': 5}} "
             "(see `rayfl algos`)"]
    for title, fields in GROUPS.items():
        lines += ["", f"    {title}:"]
        lines += [f"        {name} = {default(FIELDS[name])!r}: {text}" for name, text in fields.items()]
    return "\n".join(lines) + "\n"


run.__doc__ += "\n" + config_keys_doc()
tune.__doc__ += "\n" + config_keys_doc()
