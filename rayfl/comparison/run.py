"""``compare``: several algorithms x seeds on the same federation, one MLflow parent run, one table.

Every (algorithm, seed) is one ordinary experiment (the config ``rayfl run`` would build, plus the preset),
logged as a child run of the comparison's parent run. The federation depends only on the data config and
the seed, never on the algorithm, so every algorithm of one seed sees the same partition and splits.
Under Ray the experiments run as concurrent launches, each with an equal share of the cluster; in-process
(``runtime="local"``, no Ray) they run one after another.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from rayfl.comparison.curves import metric_key, metric_name, round_curves
from rayfl.comparison.presets import PRESETS
from rayfl.comparison.table import (SAME_WORK, SETTINGS, WORK, WORST_SAMPLES, Agreement, bar_chart, cell, html,
                                    markdown, ordering_agreement, ranking, summarize_runs, with_paper)
from rayfl.config import UserError, make_config
from rayfl.divergence import Diverged
from rayfl.session import Session
from rayfl.specs import CompareOptions, CompareSpec, TrackingSpec


@dataclass
class CompareResult:
    table: pd.DataFrame  # one row per algorithm: <metric>, <metric>_std, seeds, paper <metric>
    runs: pd.DataFrame  # one row per (algorithm, seed): its final-round summary and MLflow run id
    run_id: str  # the parent MLflow run
    markdown: str
    tracking_uri: str
    preset: str | None = None
    agreement: "Agreement | None" = None  # with a preset: how many of the paper's row orderings ours keeps
    experiment_id: str = ""
    out_dir: str = ""  # the comparison's directory: the table, and a run directory per (row, seed)
    tracking_unsent: str | None = None  # the line saying which runs kept records their server did not get
    caveat: str | None = None  # the federation's warning (small validation or test splits), shown with the table

    @property
    def mlflow_url(self) -> str:
        """The parent run's page in the MLflow UI (its description is the table)."""
        from rayfl.progress import ui_url

        return ui_url(self.tracking_uri, self.experiment_id, self.run_id)

    def _what(self) -> str:
        metric = "test_acc_mean" if "test_acc_mean" in self.table else "test_loss_mean"
        done = self.table[self.table[metric] == self.table[metric]] if metric in self.table else self.table.iloc[:0]
        top = done.sort_values(metric, ascending=metric == "test_loss_mean").iloc[0] if len(done) else None
        best = (f"; best {top['algo']} (test {'acc' if metric == 'test_acc_mean' else 'loss'} "
                f"{cell(top[metric], top[f'{metric}_std'], metric == 'test_acc_mean')}"
                f"{' %' if metric == 'test_acc_mean' else ''})") if top is not None else ""
        preset = f", preset {self.preset}" if self.preset else ""
        agree = f"; {self.agreement.line()}" if self.agreement else ""
        return f"{len(self.table)} rows x {self.runs['seed'].nunique()} seeds{preset}{best}{agree}"

    def __repr__(self) -> str:
        return (f"CompareResult({self._what()})\n  .table {len(self.table)} rows, .runs {len(self.runs)} rows; "
                f"{self.mlflow_url}")

    def _repr_html_(self) -> str:
        """The table as :attr:`markdown` has it (the same cells: mean ± std over seeds, accuracy in %), its
        ordering agreement and caveat, and the link to the parent run."""
        from html import escape

        notes = [*([self.agreement.line()] if self.agreement else []), *([f"Caveat: {self.caveat}."] if self.caveat
                                                                          else [])]
        url = escape(self.mlflow_url)
        return (f"<div><b>CompareResult: {escape(self._what())}</b> (final round, mean ± std over seeds)"
                + html(self.table) + "".join(f"<div>{escape(n)}</div>" for n in notes)
                + f"<div>MLflow: <a href='{url}' target='_blank'>{url}</a></div></div>")


def parse_row(spec: str) -> tuple[str, dict, dict]:
    """One row of a comparison: ``ALGO``, or ``ALGO:KEY=VALUE:...`` where each KEY is a knob of the algorithm
    (``fedfomo:M=10``, ``persfl:variant=gd``) or a config key for that row alone (``fedfomo:val_frac=0.16``:
    FedFomo's held-out split in FedeRiCo's table). Returns (algorithm, knobs, config values); the spec itself
    is the row's label."""
    from rayfl.config import FIELDS, yaml_value

    algo, *items = [part.strip() for part in spec.split(":")]
    knobs: dict = {}
    config: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not algo or not sep or not key.strip() or key.strip() in ("algo", "seed", "params"):
            raise UserError(f"algos={spec!r}: a row is ALGO or ALGO:KEY=VALUE:... (a knob or a config key)")
        parsed = yaml_value(value.strip(), key.strip())  # a YAML scalar, as -p KEY=VALUE reads one
        if key.strip() in knobs or key.strip() in config:
            raise UserError(f"algos={spec!r}: {key.strip()} is given twice in one row; give it once")
        (config if key.strip() in FIELDS else knobs)[key.strip()] = parsed
    return algo, knobs, config


def work_of(label: str) -> str:
    """A row's local work per round, as its algorithm declares it (``Algorithm.work``)."""
    from rayfl.algorithms import get_algorithm

    return get_algorithm(row_algorithm(label)).work or SAME_WORK


def row_algorithm(label: str) -> str:
    """The algorithm a row label names, a second row's (``ALGO-SUFFIX``, see :func:`before_rows`) included."""
    from rayfl.algorithms import algorithm_names, get_algorithm

    algo = parse_row(label)[0]
    names = algorithm_names()
    if algo in names:
        return algo
    for name in names:
        if any(algo == f"{name}-{suffix}" for suffix in get_algorithm(name).compare_before.values()):
            return name
    return algo


def build_configs(algos: Sequence[str] | None, seeds: Sequence[int], preset: str | None = None,
                  params: dict | None = None, **config) -> list[tuple[str, object]]:
    """(row label, checked Config) per (row, seed): preset, then ``config`` (flags), then the row's own values,
    the algorithm and the seed. A knob in ``params`` goes to every compared algorithm that has it; one that none
    has is a user error."""
    from rayfl.algorithms import get_algorithm

    if preset is not None and preset not in PRESETS:
        raise UserError(f"preset={preset!r}: unknown; allowed: {', '.join(PRESETS)}")
    p = PRESETS.get(preset)
    rows = [r.strip() for r in (algos if algos is not None else (p.algos if p else ()))]
    if not rows:
        raise UserError("algos: name the algorithms to compare (--algos local,fedavg) or a --preset")
    if len(set(rows)) != len(rows):
        raise UserError(f"algos={','.join(rows)}: a row is named twice")
    if not isinstance(seeds, (list, tuple, range)) or not seeds or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds):
        raise UserError(f"seeds={list(seeds) if not isinstance(seeds, str) else seeds!r}: give one or more "
                        f"distinct integer seeds")
    seeds = [int(s) for s in seeds]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"seeds={seeds}: give one or more distinct seeds")
    params = {**config.pop("params", {}), **(params or {})}
    from rayfl.user_input import same_value

    parsed = {r: parse_row(r) for r in rows}
    meanings: dict = {}
    for row, (a, own_knobs, own_config) in parsed.items():  # fedfomo:M=2 and fedfomo:M=2.0 are one row
        meaning = (a, *(tuple(sorted((k, same_value(v)) for k, v in d.items())) for d in (own_knobs, own_config)))
        if meaning in meanings:
            raise UserError(f"algos: rows {meanings[meaning]!r} and {row!r} are the same run; give each once")
        meanings[meaning] = row
    knobs = {}
    for row, (a, _, _) in parsed.items():
        try:
            knobs[row] = set(get_algorithm(a).param_names())
        except KeyError as e:
            raise UserError(str(e).strip("'\"")) from None
    for k in params:
        if not any(k in names for names in knobs.values()):
            raise UserError(f"param {k}: none of {','.join(rows)} has this knob (see `rayfl algos`)")
    config.pop("seed", None)
    out = []
    for row, (a, own_knobs, own_config) in parsed.items():
        for s in seeds:
            own = {**(p.params.get(a, {}) if p else {}), **{k: v for k, v in params.items() if k in knobs[row]},
                   **own_knobs}
            cfg = make_config(None, {**(p.config if p else {}), **(p.row_config.get(a, {}) if p else {}), **config,
                                     **own_config, "algo": a, "seed": s, "params": own})
            cfg.check()
            out.append((row, cfg))
    return out


def row_settings(planned: list[tuple[str, object]]) -> dict[str, str]:
    """Row label -> what its runs set apart from the rest of the table: the algorithm's knobs that differ from
    its defaults, and the config values that differ from most rows' (a preset's row_config, a row's own
    ``:KEY=VALUE``), as ``key=value`` words ("" for a row that is the algorithm as ``rayfl run`` runs it)."""
    from collections import Counter

    from rayfl.algorithms import get_algorithm

    first = dict(planned)  # one config per row (the seeds differ in the seed only)
    flats = {row: {k: v for k, v in cfg.to_flat().items() if not k.startswith("param.")
                   and k not in ("algo", "seed", "run_name")} for row, cfg in first.items()}
    usual = {k: Counter(repr(f[k]) for f in flats.values() if k in f).most_common(1)[0][0]
             for k in {k for f in flats.values() for k in f}}
    out = {}
    for row, cfg in first.items():
        defaults = dataclasses.asdict(get_algorithm(cfg.algo).make_params({}))
        knobs = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in dataclasses.asdict(get_algorithm(cfg.algo).make_params(cfg.params)).items()
                 if v != defaults.get(k)]
        own = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in flats[row].items()
               if repr(v) != usual[k]]
        out[row] = " ".join(knobs + own)
    return out


def before_label(label: str, suffix: str) -> str:
    """A second row's label: ``ALGO-SUFFIX`` with the row's own ``:KEY=VALUE`` after (``ALGO:M=10`` ->
    ``ALGO-SUFFIX:M=10``)."""
    algo, sep, rest = label.partition(":")
    return f"{algo}-{suffix}{sep}{rest}"


def before_rows(label: str) -> dict[str, str]:
    """Stage -> the label of the row's second row, for a last stage that its algorithm asks a comparison to show
    both ways (``Algorithm.compare_before``): the run as it ends, and as of its last evaluated round before."""
    from rayfl.algorithms import get_algorithm

    try:
        algo = get_algorithm(parse_row(label)[0])
    except KeyError:
        return {}
    return {stage: before_label(label, suffix) for stage, suffix in algo.compare_before.items()}


def final_rows(label: str, seed: int, out: dict) -> list[dict]:
    """The run's final-round summary as a table row; a last stage its algorithm shows both ways
    (:func:`before_rows`) adds the row of its last evaluated round before that stage."""
    from rayfl.tracking import numeric

    from rayfl.metrics import worst_client_samples

    rows = [{"algo": label, "seed": seed, "run_id": out.get("run_id"), **numeric(out["final"])}]
    worst = worst_client_samples((out.get("per_client") or {}).values())
    if worst is not None:  # what its worst client's value rests on
        rows[0][WORST_SAMPLES] = worst
    history = out.get("history") or []
    last = history[-1].get("stage") if history else None
    second = before_rows(label).get(last) if last is not None else None
    if second:
        before = [h for h in history if h.get("stage") != last and ("test_acc_mean" in h or "test_loss_mean" in h)]
        if before:
            rows.append({"algo": second, "seed": seed, "run_id": out.get("run_id"), **numeric(before[-1])})
    return rows


def _ray_share(cfg, concurrent: int) -> tuple:
    """(client-actor resources, number of client actors) for one of ``concurrent`` experiments sharing the
    cluster evenly: the engine's own placement, planned on that share."""
    from rayfl.actors.resources import check_fits, divided, live_nodes, n_actors_for, plan_actor_resources

    share = divided(live_nodes(free=False), concurrent)  # an even part of every node
    n_actors = n_actors_for(cfg, share)
    res = plan_actor_resources(cfg, n_actors, share)
    check_fits(res, n_actors, share, cfg.clients)
    return res, n_actors


def compare(algos: Sequence[str] | None = CompareOptions.algos, seeds: Sequence[int] = CompareOptions.seeds,
            preset: str | None = CompareOptions.preset, *, params: dict | None = None,
            runtime: str = CompareOptions.runtime, max_concurrent: int | None = CompareOptions.max_concurrent,
            address: str | None = None, name: str | None = CompareOptions.name,
            on_round: Callable[[str, dict], None] | None = None, command: str | None = None,
            progress: bool | Callable[[str], None] = CompareOptions.progress, plugins: list[str] | None = None,
            **config) -> CompareResult:
    """Run every algorithm in ``algos`` with every seed in ``seeds`` on the same federation and return the
    paper-style table (mean ± std over seeds of the final round's test accuracy mean, worst client and
    bottom 10%, plus the algorithms' extra columns).

    ``config`` takes any ``rayfl run`` config key (``dataset="mnist"``, ``clients=15``, ...); ``params`` the
    algorithms' knobs (each goes to the algorithms that have it); ``preset`` one of
    :data:`rayfl.comparison.PRESETS`, whose values ``config`` overrides. ``runtime="local"`` runs in this
    process without Ray (one experiment at a time); ``"ray"`` uses the connected cluster (or starts a
    private local one) with up to ``max_concurrent`` experiments at once (default: one per CPU).
    ``on_round(label, record)`` sees every round of every experiment. ``command``: what the user typed, for
    the runs' provenance tags (default: this process's command line). ``progress``: True (the default) prints
    what will run, ``k/N done`` with an estimate of the time left as each experiment ends, and where MLflow
    shows the result; False nothing; a callable receives those lines instead. ``plugins``: .py files or module
    names to load first, as ``--plugin`` (their algorithms can be rows). The defaults are
    :class:`rayfl.specs.CompareOptions`'."""
    from rayfl.config import check_value
    from rayfl.plugins import as_sources, load_plugins

    load_plugins(as_sources(plugins))
    for key, value in {"algos": algos, "seeds": seeds, "params": params, "name": name, **config}.items():
        check_value(key, value)  # bounded before anything walks or quotes it
    spec = CompareSpec(algos=algos, seeds=seeds, preset=preset, max_concurrent=max_concurrent, runtime=runtime,
                       name=name, params=params, config=config, address=address, command=command, progress=progress)
    return compare_spec(spec, on_round=on_round)


def compare_spec(spec: CompareSpec, on_round: Callable[[str, dict], None] | None = None) -> CompareResult:
    """A :class:`rayfl.specs.CompareSpec`, as :func:`compare` and ``rayfl compare`` ask for it, in one
    :class:`rayfl.session.Session`: checks, the runs (on Ray or in this process), the table, the parent run."""
    from rayfl.experiment import prepare
    from rayfl.provenance import origin

    spec.check()
    planned = build_configs(spec.algos, spec.seeds, spec.preset, spec.params, **spec.config)
    # every user mistake surfaces here, before anything starts
    prepared = [(row, prepare(cfg)) for row, cfg in planned]
    settings = row_settings(planned)
    with Session(spec.address, TrackingSpec.of(planned[0][1])) as session:
        return _compare(spec, session, planned, prepared, settings, on_round, spec.progress, origin(spec.command))


def _compare(spec: CompareSpec, session: Session, planned: list, prepared: list, settings: dict, on_round,
             progress, provenance: dict) -> CompareResult:
    from rayfl.data.report import PartitionReport
    from rayfl.progress import partition

    preset, runtime, max_concurrent = spec.preset, spec.runtime, spec.max_concurrent
    base = planned[0][1]
    session.check_here(max(cfg.torch_threads for _, cfg in planned))
    session.check_store()  # as run checks it: no directories made for a store it refuses
    uri, exp_id = session.tracking.uri, session.experiment_id()
    order = list(dict.fromkeys(row for row, _ in planned))
    seeds = list(dict.fromkeys(cfg.seed for _, cfg in planned))
    name = spec.name or base.run_name or f"compare-{preset or base.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    # the table, and each run's directory (its checkpoints, records kept for rayfl sync) below it
    from rayfl.config import Config
    from rayfl.multinode import shared_default

    parent_dir = None
    if runtime == "ray":
        session.connect_early()  # on a cluster, connected first: how many machines it spans decides where files go
        session.check_store_shared()
        parent_dir = shared_default("--out-dir", None if base.out_dir == Config.out_dir else base.out_dir, "runs")
    out_dir = new_dir(os.path.join(parent_dir or base.out_dir, "compare"), name)

    shared = {k: v for k, v in base.to_flat().items() if k not in ("algo", "seed", "run_name")
              and not k.startswith("param.")}
    params = {**shared, "compare_algos": ",".join(order), "compare_seeds": ",".join(map(str, seeds)),
              "compare_preset": preset or "", "compare_runtime": runtime}
    parent_run = session.open_parent(name, {**provenance, "rayfl.role": "compare", "rayfl.compare_preset": preset or ""},
                                     {k: "" if v is None else v for k, v in params.items()})
    parent = parent_run.run_id

    say = progress if callable(progress) else (lambda line: print(line, flush=True)) if progress else None
    total, t_start, finished = len(prepared), time.perf_counter(), []
    reports = {id(p): PartitionReport.of(p) for _, p in prepared}  # each run's federation, for its child run
    if say:
        from rayfl.progress import ui_url

        say(f"compare: {len(order)} rows x {len(seeds)} seeds = {total} runs "
            f"({'one at a time, in this process' if runtime == 'local' else 'on Ray'}); parent run {parent}; "
            f"watch it in MLflow: {ui_url(uri, exp_id, parent, spec.ui_port)}")
        # once per seed: every row of a seed has its federation (a row with config of its own aside)
        first = {p.cfg.seed: reports[id(p)] for _, p in reversed(prepared)}
        for seed in seeds:
            partition(first[seed], say, prefix=f"compare: seed {seed} ")

    def one(item) -> list[dict]:
        row, p = item
        cfg = p.cfg
        label = f"{row} s{cfg.seed}"
        # the row first in the name (the runs table cuts it), and as tags to group the runs table by
        tracking = session.tracking.for_run(
            label, experiment_id=exp_id, parent_run_id=parent, extra_params={"compare": name},
            tags={**provenance, "rayfl.role": "compare-run", "rayfl.compare_row": row, "rayfl.seed": str(cfg.seed)},
            partition=reports[id(p)].to_dict())
        show = (lambda rec: on_round(label, rec)) if on_round else None
        run_dir = run_dirs[label]
        try:
            if runtime == "local":
                from rayfl.inprocess import run_in_process

                out = run_in_process(p, tracking, run_dir, on_round=show)
            else:
                from rayfl.actors.launch import launch

                res, n_actors = _ray_share(cfg, concurrent)
                out = launch(p, tracking, checkpoint_dir=run_dir, on_round=show, resources=res,
                             actor_options=[{}] * n_actors)
        except Diverged as e:  # no result: the row says where it diverged (its MLflow run is FAILED)
            out = None
            outcome = f"diverged at round {e.round}"
            rows = [{"algo": row, "seed": cfg.seed, "run_id": None, "diverged": e.round}]
        else:
            acc = "test_acc_mean" in out["final"]  # the number as the table will show it (cell)
            value = cell(out["final"].get("test_acc_mean" if acc else "test_loss_mean", math.nan), math.nan, acc)
            outcome = f"test {'accuracy' if acc else 'loss'} {value}" + ("%" if acc and value != "-" else "")
            rows = final_rows(row, cfg.seed, out)
            histories.setdefault(row, []).append(out.get("history") or [])
        for r in rows:
            r[SETTINGS] = settings[row]
        if say:
            finished.append(label)
            done, elapsed = len(finished), time.perf_counter() - t_start
            say(f"compare: {done}/{total} done ({label}: {outcome}), elapsed {_clock(elapsed)}, "
                f"eta {_clock(elapsed / done * (total - done))}")
        return rows

    run_dirs, names, histories = {}, set(), {}
    for row, p in prepared:
        label = f"{row} s{p.cfg.seed}"
        folder = file_name(label)
        folder = f"{folder}-{len(names)}" if folder in names else folder  # two labels made one name
        names.add(folder)
        run_dirs[label] = session.run_dir(dataclasses.replace(p.cfg, out_dir=out_dir), folder)
    rows: list[dict] = []
    try:
        if runtime == "ray":
            session.start_ray()
            from rayfl.actors.resources import live_nodes, slots

            concurrent = max_concurrent or max(1, min(len(prepared), slots(base, live_nodes(free=False))))
            with ThreadPoolExecutor(concurrent) as ex:
                for part in ex.map(one, prepared):
                    rows.extend(part)
        else:
            for p in prepared:
                rows.extend(one(p))
    except BaseException:
        parent_run.end("FAILED")
        raise
    finally:
        session.close()  # Ray down (if started here), and the environment init_ray changed, as it was
    runs = pd.DataFrame(rows)
    for row in list(order):  # a second row (before_rows) right after its row
        for second in reversed(before_rows(row).values()):
            if second in set(runs["algo"]):
                order.insert(order.index(row) + 1, second)
    table = summarize_runs(runs, order)
    table[WORK] = [work_of(row) for row in table["algo"]]
    agreement = None
    if preset:
        paper = PRESETS[preset].paper_for(base.to_flat())
        table = with_paper(table, paper)
        agreement = ordering_agreement(table)
    # the federation's caveat (small validation or test splits), with the numbers wherever they go
    caveat = next((w for w in (reports[id(p)].warning() for _, p in prepared) if w), None)
    text = (markdown(table) + (f"\n\n{agreement.line()}" if agreement else "")
            + (f"\n\n**Caveat:** {caveat}." if caveat else ""))
    title = (f"{preset + ': ' if preset else ''}{base.dataset} ({base.partition}), {base.clients} clients, "
             f"{base.rounds} rounds: final round, mean ± std over {len(seeds)} seeds")
    _write_tables(out_dir, runs, table, text, preset)  # kept here whatever the tracking server does
    parent_run.stop_system()  # its last sample sent; the parent's end goes with its records below
    metric = "test_acc_mean" if "test_acc_mean" in table else "test_loss_mean"
    curves = round_curves({row: histories[row] for row in order if row in histories}, metric)
    _parent_records(out_dir, parent, uri, runs, table, text, preset, agreement, provenance["rayfl.command"], title,
                    (metric, curves), caveat)
    session.deliver(out_dir)
    late = session.unsent_line(out_dir, "run(s)")  # records their server did not get (the parent's, the runs'), for sync
    if late:
        late += f"; the table is in {os.path.join(out_dir, 'table.md')}"
    result = CompareResult(table, runs, parent, text, uri, preset, agreement, exp_id, out_dir, late, caveat)
    if say:
        from rayfl.progress import mlflow_hint

        say(f"compare: the table and each run's directory are in {out_dir}")
        say(mlflow_hint(uri, exp_id, parent, what="this comparison", port=spec.ui_port))
    return result


def file_name(label: str) -> str:
    """A row label as a directory name (``fedfomo:M=10 s0`` -> ``fedfomo_M=10_s0``)."""
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", label).strip("_.") or "run"


def new_dir(parent: str, name: str) -> str:
    """``parent/name``, made new: ``name-2``, ``name-3``, ... when that exists (a name given twice)."""
    base = os.path.abspath(os.path.join(os.path.expanduser(parent), file_name(name)))
    for k in range(1, 10_000):
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"out_dir={parent!r}: cannot make the comparison's directory {path} "
                            f"({e.strerror or e})") from None
    raise UserError(f"out_dir={parent!r}: {base}-2 .. -9999 all exist; give another --name")


def _write_tables(out_dir: str, runs: pd.DataFrame, table: pd.DataFrame, text: str, preset: str | None) -> None:
    """The comparison's files (as logged to its parent run) in ``out_dir``."""
    table.to_csv(os.path.join(out_dir, "table.csv"), index=False)
    runs.to_csv(os.path.join(out_dir, "runs.csv"), index=False)
    head = f"# rayfl compare{f' --preset {preset}' if preset else ''}\n\n"
    if preset:
        head += PRESETS[preset].what + f"\n\nPaper: {PRESETS[preset].paper_source}\n\n"
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(head + text + "\n")


def _wrapped(command: str, width: int = 100) -> str:
    """A command as Markdown that wraps (a code block does not: it would widen the page): inline code by words."""
    import textwrap

    lines = textwrap.wrap(command, width, break_on_hyphens=False, break_long_words=False)
    return "\n".join(f"`{line}`" for line in lines)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def _parent_records(out_dir: str, run_id: str, uri: str, runs: pd.DataFrame, table: pd.DataFrame, text: str,
                    preset: str | None, agreement: "Agreement | None" = None, command: str = "",
                    title: str = "", curves: tuple[str, pd.DataFrame] | None = None, caveat: str | None = None) -> str:
    """What the parent run gets, as records in ``out_dir``'s outbox (sent at once when its server answers,
    else by ``rayfl sync``): table (CSV, Markdown), per-run rows, the bar chart of the final round, and each
    row's metric over rounds (``curves``: its mean over seeds and their spread, by round as the step: one chart
    compares the rows in MLflow's chart view, and ``plots/rounds.png``); its description (the run's Overview)
    is the table itself, with the setting and the command. A table cell is no metric of its own: a chart of
    one value each would flood the chart view (they are in table.csv)."""
    import matplotlib.pyplot as plt

    from rayfl.plots import rounds_plot
    from rayfl.tracking import Outbox, metrics_record, outbox_dir

    now = int(time.time() * 1000)
    records = []
    if agreement is not None and agreement.pairs:
        records.append(metrics_record({"ordering_agreement": agreement.fraction}, 0, now))
    metric, rounds = curves if curves is not None else ("", pd.DataFrame())
    for rnd, at in rounds.groupby("round"):
        values = {metric_name(metric, "mean", r["algo"]): r["mean"] for _, r in at.iterrows()}
        values.update({metric_name(metric, "std", r["algo"]): r["std"] for _, r in at.iterrows() if r["seeds"] > 1})
        records.append(metrics_record(values, int(rnd), now))
    box = Outbox(outbox_dir(out_dir))
    box.write_run(run_id=run_id, tracking_uri=uri, status="FINISHED", end_time=now)
    tree = os.path.join(box.files, box.new_files())
    files = os.path.join(tree, "compare")
    os.makedirs(files)
    _write_tables(files, runs, table, text, preset)
    figure = bar_chart(table, title + (f"\ncaveat: {caveat}" if caveat else ""))
    figure.savefig(os.path.join(files, "comparison.png"))
    plt.close(figure)
    if len(rounds):
        os.makedirs(os.path.join(tree, "plots"))
        figure = rounds_plot(rounds, metric, title.split(": final round")[0], f"caveat: {caveat}" if caveat else "")
        figure.savefig(os.path.join(tree, "plots", "rounds.png"))
        plt.close(figure)
    # the answer first: MLflow's Overview shows a description's first lines and folds the rest under "Show more";
    # the ranking is narrow (no sideways scroll), the full table below it, the command in a block that wraps
    about = PRESETS[preset].what + f" Paper: {PRESETS[preset].paper_source}." if preset else ""
    first = ranking(table) + (f"\n\n**Caveat:** {caveat}." if caveat else "")
    note = (first + "\n\nThe full table (mean ± std over seeds):\n\n" + text + (f"\n\n{about}" if about else "")
            + (f"\n\n{_wrapped(command)}\n" if command else "\n"))
    box.spill([*records, ("tags", [("mlflow.note.content", note)])])
    return box.dir
