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


def run_one(preset: str, seeds: list[int], data_root: str | None, out: str, extra: dict) -> dict:
    from rayfl.comparison import compare

    config = dict(extra)
    if data_root:
        config["data_root"] = data_root
    tag = "".join(f"-{k}{v}" for k, v in extra.items())
    t0 = time.perf_counter()
    res = compare(None, seeds, preset, runtime="local", tracking_uri=f"sqlite:///{out}/mlflow.db",
                  out_dir=os.path.join(out, "runs"), **config)
    wall = time.perf_counter() - t0
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in extra.items())
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
    ap.add_argument("--data-root", default=None, help="MNIST's IDX files (the presets' dataset)")
    ap.add_argument("--columns", action="store_true",
                    help="run every column a preset's paper reports (e.g. FedeRiCo's 2, 3 and 4 groups)")
    ap.add_argument("--out", default="reproduce-out")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--assemble", metavar="DIR", help="print the tables of the records under DIR, made again")
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
    for name in names:
        p = PRESETS[name]
        variants = [{}]
        if args.columns and p.paper_by:
            variants = [{p.paper_by[0]: value} for value, _ in p.paper_by[1]]
        for extra in variants:
            run_one(name, args.seeds, args.data_root, args.out, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
