"""Every preset of ``rayfl compare`` with its seeds, each table written as Markdown with its ordering agreement.

Runs the presets one after another in this process (``--local``: no Ray, one experiment at a time), so two of
these on disjoint presets keep a 2-core machine busy without Ray's start-up per experiment:

    .venv/bin/python benchmarks/reproduce_presets.py --data-root ../shared/datasets/mnist-t10k \\
        --presets fedfomo-pathological,persfl-ds1 --out /tmp/repro
    .venv/bin/python benchmarks/reproduce_presets.py --list
    .venv/bin/python benchmarks/reproduce_presets.py --assemble /tmp/repro > tables.md   # the tables, again

A preset whose paper reports several columns of one config key (FedeRiCo's groups) runs once per column with
``--columns``. Each run writes ``<out>/<preset>[-<key><value>].md`` (the command, the wall time, the table and
its ordering agreement) and a ``.json`` beside it; ``benchmarks/results_compare.md`` is assembled from them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def run_one(preset: str, seeds: list[int], data_root: str | None, out: str, extra: dict,
            algos: list[str] | None = None) -> dict:
    from rayfl.comparison import compare

    config = dict(extra)
    if data_root:
        config["data_root"] = data_root
    tag = "".join(f"-{k}{v}" for k, v in extra.items()) + ("-" + "+".join(algos) if algos else "")
    t0 = time.perf_counter()
    res = compare(algos, seeds, preset, runtime="local", tracking_uri=f"sqlite:///{out}/mlflow.db",
                  out_dir=os.path.join(out, "runs"), **config)
    wall = time.perf_counter() - t0
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in extra.items())
    flags += f" --algos {','.join(algos)}" if algos else ""
    command = (f"rayfl compare --preset {preset} {flags} --data-root {data_root} --seeds "
               f"{' '.join(map(str, seeds))} --local").replace("  ", " ")
    record = {"preset": preset, "extra": extra, "command": command, "wall_seconds": wall,
              "table": res.table.to_dict(orient="records"), "runs": res.runs.to_dict(orient="records"),
              "agreement": None if res.agreement is None else
              {"column": res.agreement.column, "agree": res.agreement.agree, "pairs": res.agreement.pairs,
               "broken": res.agreement.broken, "line": res.agreement.line()}}
    with open(os.path.join(out, f"{preset}{tag}.md"), "w") as f:
        f.write(f"```\n{command}\n```\n\n{wall:.0f} s\n\n{res.markdown}\n")
    with open(os.path.join(out, f"{preset}{tag}.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(f"{preset}{tag}: {wall:.0f} s; {record['agreement']['line'] if record['agreement'] else ''}", flush=True)
    return record


def table_of(record: dict) -> str:
    """A run's table made again from its per-run rows with this tree's table code (rows, the paper's numbers,
    the ordering agreement and the local work), and the command and wall time above it."""
    import pandas as pd

    from rayfl.comparison.presets import PRESETS
    from rayfl.comparison.run import before_rows, work_of
    from rayfl.comparison.table import WORK, markdown, ordering_agreement, summarize_runs, with_paper

    runs = pd.DataFrame(record["runs"])
    preset = PRESETS[record["preset"]]
    order = []
    for row in preset.algos:
        order.append(row)
        order += [second for second in before_rows(row).values() if second in set(runs["algo"])]
    table = summarize_runs(runs, [r for r in order if r in set(runs["algo"])])
    table[WORK] = [work_of(r) for r in table["algo"]]
    config = {**preset.config, **record["extra"]}
    table = with_paper(table, preset.paper_for(config))
    agreement = ordering_agreement(table)
    text = markdown(table) + (f"\n\n{agreement.line()}" if agreement else "")
    return f"```\n{record['command']}\n```\n\n{record['wall_seconds']:.0f} s\n\n{text}\n"


def record_from_store(db: str, preset: str, data_root: str | None, extra: dict) -> dict:
    """The record of a comparison stopped before its end, from its MLflow store (the SQLite file of ``--out``):
    each finished child run's final metrics (its latest value of each, the final round's), row and seed from its
    tags; the wall time is the sum of those runs' own. Rows or seeds not finished are absent from the table."""
    import sqlite3

    from rayfl.comparison.run import build_configs, row_settings
    from rayfl.comparison.table import SETTINGS

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    runs, wall = [], 0.0
    for run_id, start, end in con.execute("SELECT run_uuid, start_time, end_time FROM runs WHERE status = "
                                          "'FINISHED' AND lifecycle_stage = 'active' ORDER BY start_time"):
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)))
        if tags.get("rayfl.role") != "compare-run":
            continue
        metrics = dict(con.execute("SELECT key, value FROM latest_metrics WHERE run_uuid = ?", (run_id,)))
        runs.append({"algo": tags["rayfl.compare_row"], "seed": int(tags["rayfl.seed"]), "run_id": run_id,
                     **{k: v for k, v in metrics.items() if "/" not in k}})
        wall += (end - start) / 1000
    con.close()
    rows = list(dict.fromkeys(r["algo"] for r in runs))
    settings = row_settings(build_configs(rows, [0], preset, **({"data_root": data_root} if data_root else {}),
                                          **extra))
    for r in runs:
        r[SETTINGS] = settings.get(r["algo"], "")
    seeds = sorted({r["seed"] for r in runs})
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in extra.items())
    return {"preset": preset, "extra": extra, "wall_seconds": wall, "runs": runs,
            "command": f"rayfl compare --preset {preset}{flags} --algos {','.join(rows)} --data-root {data_root} "
                       f"--seeds {' '.join(map(str, seeds))} --local   # the runs that finished, read from {db}"}


def assemble(directory: str) -> None:
    """Every record under ``directory`` (the ``--out`` of one or more runs), its table made again."""
    import glob

    for path in sorted(glob.glob(os.path.join(directory, "**", "*.json"), recursive=True)):
        with open(path) as f:
            record = json.load(f)
        print(f"### {record['preset']}{''.join(f' ({k} = {v})' for k, v in record['extra'].items())}\n")
        print(table_of(record))


def main(argv=None) -> int:
    from rayfl.comparison.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", default=None, help="comma-separated rows of the preset (default: every row)")
    ap.add_argument("--data-root", default=None, help="MNIST's IDX files (the presets' dataset)")
    ap.add_argument("--columns", action="store_true",
                    help="run every column a preset's paper reports (e.g. FedeRiCo's 2, 3 and 4 groups)")
    ap.add_argument("--out", default="reproduce-out")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--assemble", metavar="DIR", help="print the tables of the records under DIR, made again")
    ap.add_argument("--from-store", metavar="DB", help="write the record of the one preset of --presets from the "
                    "finished runs in DB (the mlflow.db of an --out whose run was stopped) to --out, and print it")
    args = ap.parse_args(argv)
    if args.assemble:
        assemble(args.assemble)
        return 0
    names = [p.strip() for p in args.presets.split(",") if p.strip()]
    if args.list:
        for name in PRESETS:
            print(f"{name}: {len(PRESETS[name].algos)} rows")
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.from_store:
        [name] = names
        record = record_from_store(args.from_store, name, args.data_root, {})
        with open(os.path.join(args.out, f"{name}-finished.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(table_of(record))
        return 0
    for name in names:
        p = PRESETS[name]
        variants = [{}]
        if args.columns and p.paper_by:
            variants = [{p.paper_by[0]: value} for value, _ in p.paper_by[1]]
        for extra in variants:
            run_one(name, args.seeds, args.data_root, args.out, extra,
                    [a.strip() for a in args.algos.split(",") if a.strip()] if args.algos else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
