"""``compare``: several algorithms x seeds on the same federation, one MLflow parent run, one table.

Every (algorithm, seed) is one ordinary experiment (the config ``rayfl run`` would build, plus the preset),
logged as a child run of the comparison's parent run. The federation depends only on the data config and
the seed, never on the algorithm, so every algorithm of one seed sees the same partition and splits.
Under Ray the experiments run as concurrent launches, each with an equal share of the cluster; in-process
(``runtime="local"``, no Ray) they run one after another.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd

from rayfl.comparison.presets import PRESETS
from rayfl.comparison.table import bar_chart, markdown, summarize_runs, with_paper
from rayfl.config import UserError, make_config

NO_FINAL_UPDATE = "fedfomo-no-final-update"  # FedFomo at its last training round, before its extra update


@dataclass
class CompareResult:
    table: pd.DataFrame  # one row per algorithm: <metric>, <metric>_std, seeds, paper <metric>
    runs: pd.DataFrame  # one row per (algorithm, seed): its final-round summary and MLflow run id
    run_id: str  # the parent MLflow run
    markdown: str
    tracking_uri: str
    preset: str | None = None


def build_configs(algos: Sequence[str] | None, seeds: Sequence[int], preset: str | None = None,
                  params: dict | None = None, **config) -> list:
    """One checked Config per (algorithm, seed): preset, then ``config`` (flags), then the algorithm and seed.
    A knob in ``params`` goes to every compared algorithm that has it; one that none has is a user error."""
    from rayfl.algorithms import get_algorithm

    if preset is not None and preset not in PRESETS:
        raise UserError(f"preset={preset!r}: unknown; allowed: {', '.join(PRESETS)}")
    p = PRESETS.get(preset)
    algos = list(algos or (p.algos if p else ()))
    if not algos:
        raise UserError("algos: name the algorithms to compare (--algos local,fedavg) or a --preset")
    if len(set(algos)) != len(algos):
        raise UserError(f"algos={','.join(algos)}: an algorithm is named twice")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"seeds={seeds}: give one or more distinct seeds")
    params = {**config.pop("params", {}), **(params or {})}
    knobs = {}
    for a in algos:
        try:
            knobs[a] = set(get_algorithm(a).param_names())
        except KeyError as e:
            raise UserError(str(e).strip("'\"")) from None
    for k in params:
        if not any(k in names for names in knobs.values()):
            raise UserError(f"param {k}: none of {','.join(algos)} has this knob (see `rayfl algos`)")
    config.pop("seed", None)
    cfgs = []
    for a in algos:
        for s in seeds:
            own = {**(p.params.get(a, {}) if p else {}), **{k: v for k, v in params.items() if k in knobs[a]}}
            cfg = make_config(None, {**(p.config if p else {}), **config, "algo": a, "seed": s, "params": own})
            cfg.check()
            cfgs.append(cfg)
    return cfgs


def final_rows(algo: str, seed: int, out: dict) -> list[dict]:
    """The run's final-round summary as a table row; FedFomo's extra update-only round shown both ways."""
    from rayfl.tracking import numeric

    rows = [{"algo": algo, "seed": seed, "run_id": out.get("run_id"), **numeric(out["final"])}]
    history = out.get("history") or []
    if algo == "fedfomo" and history and history[-1].get("stage") == "update":
        trained = [h for h in history if h.get("stage") == "train" and ("test_acc_mean" in h or "test_loss_mean" in h)]
        if trained:
            rows.append({"algo": NO_FINAL_UPDATE, "seed": seed, "run_id": out.get("run_id"), **numeric(trained[-1])})
    return rows


def _ray_share(cfg, concurrent: int) -> tuple:
    """(client-actor resources, number of client actors) for one of ``concurrent`` experiments sharing the
    cluster evenly: the engine's own placement, planned on that share."""
    import ray

    from rayfl.actors.resources import check_fits, n_actors_for, plan_actor_resources

    cluster = ray.cluster_resources()
    share = {k: float(v) / concurrent for k, v in cluster.items() if k in ("CPU", "GPU", "memory")}
    n_actors = n_actors_for(cfg, share)
    res = plan_actor_resources(cfg, n_actors, share)
    check_fits(res, n_actors, share, cfg.clients)
    return res, n_actors


def compare(algos: Sequence[str] | None = None, seeds: Sequence[int] = (0, 1, 2), preset: str | None = None, *,
            params: dict | None = None, runtime: str = "ray", max_concurrent: int | None = None,
            address: str | None = None, name: str | None = None,
            on_round: Callable[[str, dict], None] | None = None, **config) -> CompareResult:
    """Run every algorithm in ``algos`` with every seed in ``seeds`` on the same federation and return the
    paper-style table (mean ± std over seeds of the final round's test accuracy mean, worst client and
    bottom 10%, plus the algorithms' extra columns).

    ``config`` takes any ``rayfl run`` config key (``dataset="mnist"``, ``clients=15``, ...); ``params`` the
    algorithms' knobs (each goes to the algorithms that have it); ``preset`` one of
    :data:`rayfl.comparison.PRESETS`, whose values ``config`` overrides. ``runtime="local"`` runs in this
    process without Ray (one experiment at a time); ``"ray"`` uses the connected cluster (or starts a
    private local one) with up to ``max_concurrent`` experiments at once (default: one per CPU).
    ``on_round(label, record)`` sees every round of every experiment."""
    from rayfl.experiment import prepare
    from rayfl.tracking import ensure_experiment, resolve_tracking_uri

    if runtime not in ("ray", "local"):
        raise UserError(f"runtime={runtime!r}: allowed: ray, local")
    if max_concurrent is not None and max_concurrent < 1:
        raise UserError(f"max_concurrent={max_concurrent}: must be an integer >= 1")
    cfgs = build_configs(algos, seeds, preset, params, **config)
    prepared = [prepare(cfg) for cfg in cfgs]  # every user mistake surfaces here, before anything starts
    base = cfgs[0]
    uri = resolve_tracking_uri(base.tracking_uri)
    exp_id = ensure_experiment(uri, base.experiment)
    order = list(dict.fromkeys(c.algo for c in cfgs))
    seeds = list(dict.fromkeys(c.seed for c in cfgs))
    name = name or base.run_name or f"compare-{preset or base.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parent = client.create_run(exp_id, run_name=name, tags={"rayfl.role": "compare"}).info.run_id
    shared = {k: v for k, v in base.to_flat().items() if k not in ("algo", "seed", "run_name")
              and not k.startswith("param.")}
    for k, v in {**shared, "compare_algos": ",".join(order), "compare_seeds": ",".join(map(str, seeds)),
                 "compare_preset": preset or "", "compare_runtime": runtime}.items():
        client.log_param(parent, k, "" if v is None else v)

    def one(p) -> list[dict]:
        cfg = p.cfg
        label = f"{cfg.algo} s{cfg.seed}"
        tracking = {"tracking_uri": uri, "experiment_id": exp_id, "run_name": f"{name}/{label}",
                    "parent_run_id": parent, "extra_params": {"compare": name}}
        show = (lambda rec: on_round(label, rec)) if on_round else None
        if runtime == "local":
            from rayfl.inprocess import run_in_process

            out = run_in_process(p, tracking, on_round=show)
        else:
            from rayfl.actors.launch import launch

            res, n_actors = _ray_share(cfg, concurrent)
            out = launch(p, tracking, on_round=show, resources=res, actor_options=[{}] * n_actors)
        return final_rows(cfg.algo, cfg.seed, out)

    started_ray = False
    rows: list[dict] = []
    try:
        if runtime == "ray":
            import ray

            from rayfl.api import start_ray

            started_ray = start_ray(address, lambda event: None)
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
            concurrent = max_concurrent or max(1, min(len(prepared), int(cpus // max(1, base.torch_threads))))
            with ThreadPoolExecutor(concurrent) as ex:
                for part in ex.map(one, prepared):
                    rows.extend(part)
        else:
            for p in prepared:
                rows.extend(one(p))
    except BaseException:
        client.set_terminated(parent, "FAILED")
        raise
    finally:
        if started_ray:
            from rayfl.cli import shutdown_ray

            shutdown_ray()  # and the environment init_ray changed, as it was
    runs = pd.DataFrame(rows)
    if NO_FINAL_UPDATE in set(runs["algo"]):
        order.insert(order.index("fedfomo") + 1, NO_FINAL_UPDATE)
    table = summarize_runs(runs, order)
    if preset:
        table = with_paper(table, PRESETS[preset].paper_for(base.to_flat()))
    text = markdown(table)
    _log_parent(client, parent, runs, table, text, preset)
    return CompareResult(table, runs, parent, text, uri, preset)


def _log_parent(client, run_id: str, runs: pd.DataFrame, table: pd.DataFrame, text: str, preset: str | None):
    """Table (CSV, Markdown), per-run rows, bar chart and one metric per algorithm x column on the parent."""
    from rayfl.tracking import numeric

    metrics = {}
    for _, r in table.iterrows():
        for k, v in numeric(r.drop(labels=["algo"]).to_dict()).items():
            if not k.startswith("paper "):
                metrics[f"{r['algo']}/{k}"] = v
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
    with tempfile.TemporaryDirectory() as tmp:
        table.to_csv(os.path.join(tmp, "table.csv"), index=False)
        runs.to_csv(os.path.join(tmp, "runs.csv"), index=False)
        head = f"# rayfl compare{f' --preset {preset}' if preset else ''}\n\n"
        if preset:
            head += PRESETS[preset].what + f"\n\nPaper: {PRESETS[preset].paper_source}\n\n"
        with open(os.path.join(tmp, "table.md"), "w") as f:
            f.write(head + text + "\n")
        client.log_artifacts(run_id, tmp, "compare")
    client.log_figure(run_id, bar_chart(table, preset or ""), "compare/comparison.png")
    client.set_terminated(run_id, "FINISHED")
