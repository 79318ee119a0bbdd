"""The ``rayfl tune`` command: its parser, :func:`cmd_tune`, and :func:`run_sweep`, which runs a
:class:`rayfl.specs.SweepSpec` (``rayfl tune`` and :func:`rayfl.tune` both call it): the Tuner, and the end of a
sweep.

MLflow: the sweep process creates the parent run; every trial's driver opens a child run with
``parent_run_id``; at the end the parent gets the results table (CSV) and a plot of the metric against each
swept knob.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import yaml

from rayfl.config import FIELDS, UserError, make_config, read_yaml
from rayfl.flags import add_config_arguments, add_options, add_session_arguments, parse_params
from rayfl.progress import ConsoleProgress, summary_table
from rayfl.session import Session
from rayfl.specs import SweepOptions, SweepSpec, TrackingSpec, check_name
from rayfl.sweep.placement import _bundles_for, _pg_factory, bundle_total
from rayfl.sweep.progress import _progress_callback, silent_reporter
from rayfl.sweep.search import _search_alg, _search_space, selectable_metrics
from rayfl.sweep.space import MAX_TRIALS, Plan, Space, find_space_file, load_space, plan_sweep, validate_space
from rayfl.sweep.trial import TrialContext, run_trial

SWEEP_FILE = "rayfl_sweep.json"


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------
def add_tune_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tune", help="sweep an algorithm's hyperparameters with Ray Tune",
        description="A Ray Tune sweep over tune_spaces/<algo>.yaml (or --space FILE); flags fix the rest of the "
                    "experiment as in `rayfl run`. Every trial is one experiment and one MLflow child run under "
                    "the sweep's parent run.")
    add_config_arguments(p)
    g = p.add_argument_group("sweep")
    add_options(g, SweepOptions)
    add_session_arguments(g, resume="go on with an interrupted sweep (its directory), from rayfl's own records "
                                    "there (Tune's state files are never read); --tracking-uri / --stage-cache say "
                                    "where it writes when the recorded ones lie outside DIR")
    p.set_defaults(handler=cmd_tune)


def _arg_values(s: SweepSpec) -> tuple[dict, dict, dict]:
    """The config file's keys, the keys given over it, the knobs given over it."""
    return (read_yaml(s.config) if s.config else {}), dict(s.values), dict(s.params)


def _default_metric(task: str, metric: str | None, mode: str | None, val_frac: float = 0.2) -> tuple[str, str]:
    metric = metric or ("val_loss_mean" if task == "regression" else "val_acc_mean")
    if metric.startswith("test_") or metric.startswith("final_test") or metric.startswith("global_"):
        raise UserError(f"--metric {metric}: hyperparameters are selected on validation, never on test "
                        f"(use val_acc_mean, val_loss_mean, ...)")
    allowed = selectable_metrics(task)
    if metric not in allowed:
        raise UserError(f"--metric {metric}: unknown for a {task} task; allowed: {', '.join(allowed)}")
    if metric.startswith("val_") and not val_frac > 0:
        raise UserError(f"--metric {metric}: needs a validation split (val_frac={val_frac}; give it a value > 0)")
    return metric, mode or ("min" if "loss" in metric else "max")


def _scheduler(kind: str, metric: str, mode: str, grace: int):
    if kind == "fifo":
        return None
    from ray.tune.schedulers import ASHAScheduler

    # max_t only caps: every trial ends by itself after its last round; rungs at grace * 4^k rounds.
    return ASHAScheduler(time_attr="training_iteration", max_t=100_000,
                         grace_period=grace, reduction_factor=4)


def sweep_plan(meta: dict) -> str:
    """What will run: ``persfl, 35 trials: lam in {0, 0.25, ...} x T in {1, 3, 5} (grid)`` (braces: a Markdown
    description would read brackets as a link)."""
    grid = [f"{k} in {{{', '.join(_show(v) for v in values)}}}" for k, values in meta["space"]["grid"].items()]
    drawn = [f"{k} ~ {kind}({', '.join(_show(v) for v in (args if isinstance(args, list) else [args]))})"
             for k, spec in meta["space"]["random"].items() for kind, args in spec.items()]
    over = " x ".join(grid + drawn) or "nothing swept"
    repeats = f", {meta['num_samples']} repeats" if meta["search"] == "grid" and meta["num_samples"] > 1 else ""
    return f"{meta['algo']}, {meta['n_trials']} trial(s): {over} ({meta['search']}{repeats})"


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def trial_resources(bundles: list[dict]) -> str:
    """A trial's share in words: ``1 CPU, its clients in its own process`` or ``2 CPUs: a driver and 2 client
    actors``."""
    total = bundle_total(bundles)
    share = f"{total.get('CPU', 0):g} CPU{'s' if total.get('CPU', 0) != 1 else ''}" + (
        f" and {total['GPU']:g} GPU" if total.get("GPU") else "")
    if len(bundles) == 1:
        return f"{share}, its clients in its own process"
    return f"{share}: a driver and {len(bundles) - 2} client actor{'s' if len(bundles) != 3 else ''}"


def best_of(table, meta: dict) -> dict:
    """The best trial's knobs and its metric (the table's first row, best first), or {} when none reported."""
    metric = meta["metric"]
    if not len(table) or metric not in table or table[metric].isna().all():
        return {}
    return {**{k: _plain(table[k].iloc[0]) for k in meta["swept"] if k in table},  # a column keeps its type
            metric: float(table[metric].iloc[0])}


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def sweep_markdown(meta: dict, df, best: dict, best_run: tuple[str, str] | None = None, top: int = 10,
                   final: dict | None = None) -> str:
    """The parent run's description: one headline line (the best trial's selection metric, named, and its test
    mean and worst client: ``final``, its last report), the best trial's knobs and metric (``best_run``: its
    MLflow run's id and name, linked), the setting, the best trials as a table, and the command."""
    from rayfl.tracking import best_trial_line, setting

    metric = meta["metric"]
    knobs = ", ".join(f"{k}={_show(v)}" for k, v in best.items() if k != metric)
    link = (f", its run [{best_run[1]}](#/experiments/{meta['experiment_id']}/runs/{best_run[0]})"
            if best_run else "")
    lines = [best_trial_line(metric, {**(final or {}), metric: best[metric]}), "",
             f"Best trial: {knobs or 'the only one'}, {metric} {best[metric]:.4f} (final round){link}", "",
             f"{sweep_plan(meta)}; {setting(make_config(None, meta['base']))}", ""]
    cols = [c for c in (*meta["swept"], metric, "test_acc_mean", "test_loss_mean", "status", "rounds") if c in df]
    cols = list(dict.fromkeys(cols))
    lines += ["| " + " | ".join(f"{c} &emsp;" for c in cols) + " |", "|" + "---|" * len(cols)]  # MLflow: no padding
    for _, row in df.head(top).iterrows():
        lines.append("| " + " | ".join("" if row[c] != row[c] else f"{row[c]:.4f}" if isinstance(row[c], float)
                                       and c not in meta["swept"] else _show(row[c]) for c in cols) + " |")
    if len(df) > top:
        lines.append(f"\n{len(df) - top} more in `results/results.csv`.")
    command = meta.get("provenance", {}).get("rayfl.command")
    if command:
        lines += ["", f"```\n{command}\n```"]
    return "\n".join(lines) + "\n"


def cmd_tune(args) -> int:
    """``rayfl tune``: the parsed flags as a :class:`rayfl.specs.SweepSpec`, run by :func:`run_sweep` (as
    :func:`rayfl.tune` runs one). 1: no trial reported the metric (the sweep has said so); 130: interrupted (it
    has said how to resume)."""
    options = {f: getattr(args, f) for f in SweepOptions.__dataclass_fields__}
    spec = SweepSpec(**options, config=args.config, params=parse_params(args.param),
                     values={k: v for k, v in vars(args).items() if k in FIELDS and k != "params"},
                     resume=args.resume, address=args.address, quiet=args.quiet, ui_port=args.ui_port)
    try:
        return run_sweep(spec)[1]
    except KeyboardInterrupt:
        return 130


def run_sweep(s: SweepSpec) -> tuple[dict, int]:
    """A sweep: checks, Ray (started here unless this process is connected), Tune, the results, in one
    :class:`rayfl.session.Session`. Returns the sweep's record (``rayfl_sweep.json``'s content) and 0, 1 when no
    trial reported the metric, or 130 when it was interrupted (resumable)."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    # Tune's legacy output engine, silenced (verbose=0 and rayfl.sweep.progress.silent_reporter): rayfl prints
    # its own lines; the new engine ignores a given reporter and notebooks fall back to the legacy one anyway
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Ctrl-C reaches us as KeyboardInterrupt (Tune's own handler would end fit() as if the sweep were done);
    # rayfl's trial records and checkpoints are on disk by then, and --resume goes on from them.
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")
    with Session(s.address, None, (lambda event: None) if s.quiet else ConsoleProgress()) as session:
        s.check()
        if s.resume:
            meta = resume_meta(s)
            session.tracking = TrackingSpec(meta["tracking_uri"], meta["experiment"],
                                            make_config(None, meta["base"]).system_metrics_interval)
        else:
            if isinstance(s.space, dict):
                s.space, s.name = _write_space(s)
            # on a cluster, connected first: how many machines it spans decides where the sweep's files go
            session.connect_early()
            meta = _new_sweep(s, session)
        session.start_ray()
        return meta, _run(meta, s.quiet, bool(s.resume), session, s.ui_port, tables=s.call is None)


def _write_space(s: SweepSpec) -> tuple[str, str]:
    """A space given as a dict is kept as a file beside the sweep (its record, and what resume reads)."""
    base = make_config(s.config, s.values)
    name = s.name if s.name is not None else f"{base.algo}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = os.path.abspath(os.path.join(s.storage_path or os.path.join(base.out_dir, "tune"), "spaces"))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(s.space, f, sort_keys=False)
    return path, name


def _load_meta(sweep_dir: str) -> dict:
    """A sweep to resume: its ``rayfl_sweep.json``, checked (:func:`rayfl.sweep.resume.load_meta`)."""
    from rayfl.sweep.resume import load_meta

    return load_meta(sweep_dir)


def resume_meta(s: SweepSpec) -> dict:
    """Everything a resume needs, checked before Ray starts (:func:`rayfl.sweep.resume.prepare_resume`)."""
    from rayfl.sweep.resume import prepare_resume

    return prepare_resume(s.resume, s.values.get("tracking_uri"), s.values.get("stage_cache"))


def _new_sweep(s: SweepSpec, session: Session) -> dict:
    """Everything decided and checked before Ray starts: values, space, metric, resources, the tracking store."""
    from rayfl.experiment import prepare
    from rayfl.provenance import origin

    file_values, flag_values, flag_params = _arg_values(s)
    algo = flag_values.get("algo") or file_values.get("algo")
    space_path = s.space or find_space_file(algo or FIELDS["algo"].default)
    space = load_space(space_path)
    plan = plan_sweep(space, file_values, flag_values, flag_params)
    n_grid = validate_space(plan)
    for note in plan.notes:
        print(f"rayfl tune: note: {note}", flush=True)
    if plan.base.get("data_root"):  # trials run in their own directories: relative paths would break there
        plan.base["data_root"] = os.path.abspath(os.path.expanduser(plan.base["data_root"]))
    base_cfg = plan.config({})
    prepared = prepare(base_cfg)  # data errors (a missing data root, ...) before any trial; gives the task
    grid_threads = [t for t in plan.space.grid.get("torch_threads", []) if isinstance(t, int)]
    session.check_here(max([base_cfg.torch_threads, *grid_threads]))  # each trial's, on this machine
    session.tracking = TrackingSpec.of(base_cfg)
    uri = session.tracking.uri
    session.check_store()  # a silent server: one line now, not MLflow's minutes of retries
    metric, mode = _default_metric(prepared.info.task, s.metric, s.mode, base_cfg.val_frac)
    search = s.search
    num_samples = s.num_samples or (1 if search == "grid" else 10)
    n_trials = n_grid * num_samples if search == "grid" else num_samples
    if n_trials > MAX_TRIALS:
        raise UserError(f"--num-samples={num_samples}: {n_grid:,} grid points x {num_samples:,} samples is "
                        f"{n_trials:,} trials; a sweep runs at most {MAX_TRIALS:,}")
    if search == "optuna":
        _search_alg("optuna", 0, 1, metric, mode)  # fails here, before anything starts, if optuna is missing
    name = s.name if s.name is not None else f"{plan.algo}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    check_name(name)
    from rayfl.multinode import shared_default

    session.check_store_shared()  # trials on several machines: a tracking server, not a file
    storage = os.path.abspath(shared_default("--storage-path", s.storage_path, "tune")
                              or os.path.join(base_cfg.out_dir, "tune"))
    sweep_dir = os.path.join(storage, name)
    if os.path.exists(os.path.join(sweep_dir, SWEEP_FILE)):
        raise UserError(f"sweep {sweep_dir} exists; resume it with --resume {sweep_dir}, or pick another --name")
    try:
        os.makedirs(storage, exist_ok=True)
        if not os.access(storage, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise UserError(f"--storage-path={storage!r}: cannot write there ({e.strerror or e}); give a writable "
                        f"directory (or --out-dir)") from None
    experiment_id = session.experiment_id()
    stage_cache = "" if not s.stage_reuse else os.path.abspath(os.path.expanduser(
        base_cfg.stage_cache or os.path.join(sweep_dir, "stages")))
    return {"name": name, "storage": storage, "sweep_dir": sweep_dir, "algo": plan.algo, "base": plan.base,
            "space": plan.space.to_dict(), "space_path": os.path.abspath(space_path), "swept": plan.space.swept(),
            "knobs": plan.knobs, "metric": metric, "mode": mode, "search": search, "num_samples": num_samples,
            "n_trials": n_trials, "max_concurrent": s.max_concurrent, "scheduler": s.scheduler,
            "grace_period": s.grace_period or max(1, base_cfg.rounds // 4), "seed": base_cfg.seed,
            "tracking_uri": uri, "experiment": base_cfg.experiment,
            "experiment_id": experiment_id, "stage_cache": stage_cache,
            "provenance": origin(s.call), "parent_run_id": None}


def _plan_from_meta(meta: dict) -> Plan:
    sp = meta["space"]
    space = Space(meta["space_path"], fixed=sp["fixed"], grid=sp["grid"],
                  random={k: next(iter(v.items())) for k, v in sp["random"].items()})
    return Plan(meta["algo"], meta["base"], space, meta["knobs"])


def _default_concurrency(meta: dict, cluster) -> int:
    """One trial per client-actor slot (``torch_threads`` CPUs, within memory), at most one per trial: trials
    are independent, so running them side by side beats spreading one over the cluster, and a trial whose
    share is one slot runs in its own (reused) process."""
    from rayfl.actors.resources import slots

    return max(1, min(meta["n_trials"], slots(make_config(None, meta["base"]), cluster)))


def _run(meta: dict, quiet: bool, resume: bool, session: Session, ui_port: int | None = None,
         tables: bool = True) -> int:
    """The sweep, and its end (:func:`_finish`); ``ui_port``: where the printed MLflow addresses point
    (``--ui-port``); ``tables``: print the results table and the best trial's (the command does; :func:`rayfl.tune`'s
    result shows them, once)."""
    import ray
    from ray import tune

    cluster = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    if not resume:
        if meta["max_concurrent"] is None:
            from rayfl.actors.resources import live_nodes

            meta["max_concurrent"] = _default_concurrency(meta, live_nodes(free=False))  # slots node by node
        if meta["max_concurrent"] < 1:
            raise UserError(f"--max-concurrent {meta['max_concurrent']}: must be >= 1")
        meta["share"] = {k: v / meta["max_concurrent"] for k, v in cluster.items()}
    share, plan = meta["share"], meta.get("plan") or _plan_from_meta(meta)
    base_bundles = _bundles_for({}, meta["base"], share)
    need = bundle_total(base_bundles)
    if any(need.get(k, 0.0) > cluster.get(k, 0.0) + 1e-9 for k in need):
        raise UserError(f"one trial needs {need} but the cluster has {cluster}: lower --cpus-per-actor / "
                        f"--gpus-per-actor or raise --clients-per-actor")
    from rayfl.actors import resources as actor_resources

    per_process = getattr(actor_resources, "ACTOR_MEMORY", 0.5 * 2**30)  # a process that imports torch
    memory = float(ray.cluster_resources().get("memory", 0.0))
    processes = meta["max_concurrent"] * len(base_bundles)  # trial, driver and client actors, all with torch
    if memory and processes * per_process > memory:
        fit = max(1, int(memory // (per_process * len(base_bundles))))
        raise UserError(f"{meta['max_concurrent']} trials at once x {len(base_bundles)} processes each need about "
                        f"{processes * per_process / 2**30:.0f} GiB, the cluster offers {memory / 2**30:.0f} GiB: "
                        f"--max-concurrent {fit} (or raise --clients-per-actor)")
    from rayfl.data.report import PartitionReport
    from rayfl.experiment import prepare
    from rayfl.progress import partition, ui_url

    base_cfg = make_config(None, meta["base"])
    report = PartitionReport.of(prepare(base_cfg))  # the base config's federation: its caveat is every trial's
    caveat = report.warning()
    if not resume:
        from rayfl.tracking import setting

        tags = {**meta.get("provenance", {}), "rayfl.sweep": meta["name"], "rayfl.kind": "sweep",
                "rayfl.role": "sweep", "rayfl.algo": meta["algo"], "rayfl.dataset": base_cfg.dataset,
                "rayfl.partition": base_cfg.partition,
                "mlflow.note.content": f"{sweep_plan(meta)}; running." + (f" **Caveat:** {caveat}." if caveat else "")
                                       + f"\n\n{setting(base_cfg)}\n"}
        params = {"algo": meta["algo"], "search": meta["search"], "scheduler": meta["scheduler"],
                  "metric": meta["metric"], "mode": meta["mode"], "num_samples": meta["num_samples"],
                  "n_trials": meta["n_trials"], "max_concurrent": meta["max_concurrent"],
                  "swept": ",".join(meta["swept"]), "space_file": meta["space_path"],
                  "trial_bundles": json.dumps(base_bundles), "stage_cache": meta["stage_cache"]}
        parent = session.open_parent(meta["name"], tags, params)
        meta["parent_run_id"] = parent.run_id
        parent.log_text(yaml.safe_dump(meta["space"], sort_keys=False), "space.yaml")
        parent.log_text(yaml.safe_dump(meta["base"], sort_keys=False), "base_config.yaml")
        os.makedirs(meta["sweep_dir"], exist_ok=True)
        with open(os.path.join(meta["sweep_dir"], SWEEP_FILE), "w") as f:
            json.dump(meta, f, indent=1, default=str)
    else:
        parent = session.reopen_parent(meta["parent_run_id"])
    print(f"rayfl tune: {sweep_plan(meta)}; {meta['max_concurrent']} at once, each {trial_resources(base_bundles)}; "
          f"optimizing {meta['metric']} ({meta['mode']}, {meta['scheduler']})", flush=True)
    print(f"rayfl tune: sweep directory {meta['sweep_dir']} (resume with --resume {meta['sweep_dir']}); "
          f"MLflow parent run {meta['parent_run_id']}", flush=True)
    partition(report, lambda line: print(line, flush=True), prefix="rayfl tune: ")  # once per sweep, with its caveat
    print(f"rayfl tune: watch it in MLflow: "
          f"{ui_url(meta['tracking_uri'], meta['experiment_id'], meta['parent_run_id'], ui_port)}",
          flush=True)

    from rayfl.sweep.records import ledger_callback, read_records, write_records

    if resume:
        from rayfl.sweep.resume import left_over, listed_searcher, optuna_after

        records = meta["records"]
        configs, n_more = left_over(meta, records)  # from rayfl's records; Tune's state files are never read
        search_alg = listed_searcher(configs, meta["metric"], meta["mode"],
                                     then=optuna_after(meta, records) if n_more else None)
        num_samples, param_space = len(configs) + n_more, {}
        kept = sum(1 for rec in records.values() if rec["status"] in ("DONE", "STOPPED"))
        print(f"rayfl tune: resuming: {kept} trial(s) finished (kept), "
              f"{sum(1 for c in configs if 'rayfl_trial' in c)} go on from their checkpoints, "
              f"{num_samples - sum(1 for c in configs if 'rayfl_trial' in c)} not started yet", flush=True)
    else:
        records, kept = {}, 0
        write_records(meta["sweep_dir"], records)
        search_alg = _search_alg(meta["search"], meta["seed"], meta["max_concurrent"], meta["metric"], meta["mode"])
        num_samples, param_space = meta["num_samples"], _search_space(plan, meta["search"])

    from rayfl.plugins import carried

    ctx = TrialContext(base=meta["base"], name=meta["name"], metric=meta["metric"], swept=list(meta["swept"]),
                       tracking=session.tracking, experiment_id=meta["experiment_id"],
                       parent_run_id=meta["parent_run_id"], sweep_dir=meta["sweep_dir"],
                       stage_cache=meta.get("stage_cache") or "", provenance=meta.get("provenance") or {},
                       plugins=carried())  # registered in each trial's process as its ctx arrives
    trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx),
                                    functools.partial(_pg_factory, base=meta["base"], share=share))
    progress = _progress_callback(meta["metric"], meta["swept"], quiet, meta["n_trials"], already=kept)
    run_config = tune.RunConfig(name=meta.get("run_name", meta["name"]), storage_path=meta["storage"], verbose=0,
                                progress_reporter=silent_reporter(),
                                callbacks=[progress, ledger_callback(meta["sweep_dir"], records)],
                                # a trial whose own process died is retried, from its own checkpoint
                                failure_config=tune.FailureConfig(max_failures=int(meta["base"].get("max_restarts", 3))))
    def server_answers() -> bool:  # asked once, when the trials are over (or the sweep was stopped)
        nonlocal reachable
        if reachable is None:
            reachable = session.answers()
        return reachable

    status, reachable = "FAILED", None
    try:
        if num_samples:  # a fresh Tuner, resumed or not: never Tuner.restore (it unpickles the sweep's files)
            tuner = tune.Tuner(
                trainable, param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=meta["metric"], mode=meta["mode"], num_samples=num_samples, search_alg=search_alg,
                    scheduler=_scheduler(meta["scheduler"], meta["metric"], meta["mode"], meta["grace_period"]),
                    max_concurrent_trials=meta["max_concurrent"],
                    reuse_actors=True),  # an in-process trial's process, imports and data cache serve the next
                run_config=run_config)
            tuner.fit()
        code = _finish(meta, read_records(meta["sweep_dir"], meta["swept"]), parent if server_answers() else None,
                       ui_port, tables)
        status = "FINISHED" if code == 0 else "FAILED"
        return code
    except KeyboardInterrupt:
        status = "KILLED"
        print(f"rayfl tune: interrupted; go on with: rayfl tune --resume {meta['sweep_dir']}", file=sys.stderr)
        return 130
    finally:
        parent.stop_system()
        if server_answers():
            _close_children(parent, meta)
            parent.end(status)
        else:  # gone: the parent run is left as it is; the results are in the sweep directory
            print(f"rayfl: warning: the tracking server at {meta['tracking_uri']} did not answer; the sweep's parent "
                  f"run {meta['parent_run_id']} was not updated; the results are in "
                  f"{os.path.join(meta['sweep_dir'], 'results.csv')}", file=sys.stderr)
        line = session.unsent_line(meta["sweep_dir"], "trial(s)")
        if line:  # the sweep is complete; those trials' MLflow runs are not, until rayfl sync
            print(line, file=sys.stderr)


def _close_children(parent, meta: dict) -> None:
    """Child runs of trials the scheduler stopped early end as FAILED (their actors went with the trial's
    placement group) and those of an interrupted sweep stay RUNNING: mark both KILLED, and say why."""
    try:
        runs = parent.children(meta["experiment_id"])
    except Exception:  # noqa: BLE001 - tidying must not hide the real outcome
        return
    stopped = set(meta.get("stopped_trials", ()))
    for run_id, params, status in runs:
        trial = params.get("tune_trial_id")
        if trial in stopped and status in ("FAILED", "RUNNING"):
            parent.stop_child(run_id, f"early, by the {meta['scheduler']} scheduler")
        elif status == "RUNNING":
            parent.stop_child(run_id, "sweep interrupted (see --resume)")


def results_table(records: dict, meta: dict):
    """One row per trial (``records``: :mod:`rayfl.sweep.records`, every trial of the sweep, resumed or not):
    its key, swept values, status, rounds done, the last reported metrics, its MLflow run; best first."""
    import pandas as pd

    rows = []
    metric = meta["metric"]
    for key, rec in records.items():
        m = rec.get("result") or {}
        row = {"trial": key}
        row.update({k: rec["config"].get(k) for k in meta["swept"]})
        row["status"] = rec["status"]
        row["rounds"] = m.get("round")
        for k in (metric, "val_acc_mean", "val_loss_mean", "test_acc_mean", "test_acc_std", "test_loss_mean"):
            if k in m and k not in row:
                row[k] = m[k]
        row["seconds"] = m.get("trial_seconds", m.get("time_total_s"))
        row["mlflow_run_id"] = m.get("mlflow_run_id")
        rows.append(row)
    df = pd.DataFrame(rows)
    if metric in df:
        df = df.sort_values(metric, ascending=meta["mode"] == "min", na_position="last")
    return df.reset_index(drop=True)


def best_record(records: dict, meta: dict) -> dict | None:
    """The trial with the best final metric among those that did not fail (as Tune's ``scope="last"``)."""
    metric, sign = meta["metric"], (1 if meta["mode"] == "max" else -1)
    scored = [rec for rec in records.values() if rec["status"] != "ERROR"
              and isinstance(rec["result"].get(metric), (int, float))]
    return max(scored, key=lambda rec: sign * rec["result"][metric]) if scored else None


def _finish(meta: dict, records: dict, parent, ui_port: int | None = None, tables: bool = True) -> int:
    """The results table printed (``tables``; else left to the API's result, but when no trial reported the
    metric) and in the sweep directory; the parent run (a :class:`rayfl.tracking.ParentRun`) gets it, its plots
    and the best trial, unless ``parent`` is None (its tracking server did not answer); ``ui_port``: where the
    printed MLflow addresses point (``--ui-port``)."""
    df = results_table(records, meta)
    meta["stopped_trials"] = list(df.trial[df.status == "STOPPED"]) if len(df) else []
    run_id, metric = meta["parent_run_id"], meta["metric"]
    path = os.path.join(meta["sweep_dir"], "results.csv")
    df.to_csv(path, index=False)
    errors = sum(1 for rec in records.values() if rec["status"] == "ERROR")
    import pandas as pd

    best = best_record(records, meta)
    if tables or best is None:
        with pd.option_context("display.width", 200, "display.max_columns", 30):
            print("\nsweep results (" + ("best first" if metric in df else "no trial reported the metric") + "):")
            shown = df.drop(columns=["mlflow_run_id"], errors="ignore")
            print(shown.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if parent is not None:
        _log_parent(parent, meta, df, path, best)
    if best is None:
        print(f"\nrayfl tune: no trial reported {metric}; {errors} trial(s) failed", file=sys.stderr)
        return 1
    best_metrics = best["result"]
    chosen = {k: best["config"].get(k) for k in meta["swept"]}
    if tables:
        print(f"\nbest ({metric} {best_metrics[metric]:.4f}, final round): "
              + ", ".join(f"{k}={v}" for k, v in chosen.items()))
        print(summary_table(best_metrics))
    if parent is not None:
        print(f"\nMLflow: parent run {run_id} in experiment {meta['experiment']!r} at {meta['tracking_uri']}, "
              f"{len(df)} child run(s)")
        from rayfl.progress import mlflow_hint

        print(mlflow_hint(meta["tracking_uri"], meta["experiment_id"], run_id, what="this sweep", port=ui_port))
    if errors:
        print(f"rayfl tune: {errors} trial(s) failed; see {meta['sweep_dir']}", file=sys.stderr)
    return 0


def _log_parent(parent, meta: dict, df, results_csv: str, best: dict | None) -> None:
    """The sweep's parent run: the results table, the metric against each knob, the best trial."""
    import pandas as pd

    from rayfl.plots import grid_heatmap, metric_vs_knob

    metric = meta["metric"]
    parent.log_artifact(results_csv, "results")
    if metric in df:
        for knob in meta["swept"]:
            sub = df[[knob, metric]].dropna()
            if len(sub):
                if not all(isinstance(v, (int, float)) for v in sub[knob]):
                    sub = sub.assign(**{knob: sub[knob].map(str)})
                parent.log_figure(metric_vs_knob(sub, knob, metric), f"plots/{metric}_vs_{knob}.png")
        numeric_knobs = [k for k in meta["swept"] if k in df and pd.api.types.is_numeric_dtype(df[k])]
        on_grid = set(meta["swept"]) <= set(meta["space"]["grid"]) and meta["search"] == "grid"
        if len(meta["swept"]) == len(numeric_knobs) == 2 and on_grid and df[metric].notna().any():
            y, x = meta["swept"]  # the first knob down the rows (PersFL: λ rows, T columns)
            parent.log_figure(grid_heatmap(df, x, y, metric, meta["mode"]), f"plots/{metric}_{y}_x_{x}.png")
    if best is None:
        return
    best_metrics = best["result"]
    chosen = {k: best["config"].get(k) for k in meta["swept"]}
    parent.log_dict({"best": chosen, metric: best_metrics[metric],
                             "mlflow_run_id": best_metrics.get("mlflow_run_id")}, "best.json")
    parent.log_metric(f"best_{metric}", float(best_metrics[metric]))
    for k, v in chosen.items():
        parent.set_tag(f"best.{k}", str(v))
    best_run = best_metrics.get("mlflow_run_id")
    try:
        best_run = (best_run, parent.run_name(best_run)) if best_run else None
    except Exception:  # noqa: BLE001 - the description links it when it can
        best_run = None
    parent.set_tag("mlflow.note.content",
                   sweep_markdown(meta, df, {**chosen, metric: best_metrics[metric]}, best_run, final=best_metrics))
