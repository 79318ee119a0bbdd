"""The ``rayfl compare`` subcommand: the flags of ``rayfl run`` plus --algos, --seeds and --preset."""

from __future__ import annotations

import sys

from rayfl.config import FIELDS, UserError, read_yaml, shown
from rayfl.flags import add_config_arguments, parse_params


def add_compare_parser(subparsers) -> None:
    from rayfl.comparison.presets import PRESETS

    p = subparsers.add_parser(
        "compare", help="several algorithms x seeds on the same federation, as one table",
        description="Run every algorithm in --algos with every seed in --seeds on the same federation (the same "
                    "partition per seed), then print the table: per algorithm, mean ± std over seeds of the final "
                    "round's test accuracy (mean, worst client, bottom 10%). One MLflow parent run, a child run "
                    "per (algorithm, seed), the table (CSV, Markdown) and a bar chart as artifacts. Presets are "
                    "each paper's setting scaled to data we have, with the paper's numbers beside ours: "
                    + ", ".join(PRESETS) + " (rayfl/comparison/presets.py).")
    add_config_arguments(p, hidden=("algo",))  # --algos names the algorithms; --algo is refused, naming it
    g = p.add_argument_group("comparison")
    g.add_argument("--algos", metavar="A,B,...", help="algorithms to compare (default: the preset's)")
    g.add_argument("--seeds", type=int, nargs="+", metavar="S", help="seeds (default: 0 1 2, or --seed)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="a paper's setting; flags override it")
    g.add_argument("--max-concurrent", type=int, metavar="N", help="experiments at once (default: one per CPU)")
    g.add_argument("--local", action="store_true", help="run in this process without Ray, one at a time")
    g.add_argument("--name", help="MLflow parent run name")
    g.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance)")
    g.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    p.set_defaults(handler=cmd_compare)


def cmd_compare(args) -> int:
    from rayfl.comparison.run import compare
    from rayfl.progress import format_round

    config = read_yaml(args.config) if args.config else {}
    if "algo" in vars(args):
        raise UserError(f"--algo {shown(args.algo)}: compare takes --algos A,B,... (did you mean --algos?)")
    config.update({k: v for k, v in vars(args).items() if k in FIELDS and k != "params"})
    file_params = config.pop("params", {})
    if not isinstance(file_params, dict) or not all(isinstance(k, str) for k in file_params):
        raise UserError(f"params={shown(file_params)} in {args.config}: must be a mapping of algorithm knobs "
                        f"(name: value)")
    params = {**file_params, **parse_params(args.param)}
    seeds = args.seeds or ([config["seed"]] if "seed" in config else [0, 1, 2])
    algos = [a.strip() for a in args.algos.split(",") if a.strip()] if args.algos else None
    if args.algos is not None and not algos:
        raise UserError(f"--algos {args.algos!r}: expected A,B,...")
    show = None if args.quiet else (lambda label, rec: print(f"{label:>14s}  {format_round(rec)}", flush=True))
    lines: list[str] = []  # the closing MLflow lines come after the table
    result = compare(algos, seeds, args.preset, params=params, runtime="local" if args.local else "ray",
                     max_concurrent=args.max_concurrent, address=args.address, name=args.name, on_round=show,
                     progress=lambda line: (lines.append(line) if line.startswith("look at it") or
                                            line.startswith("  then") else print(line, flush=True)),
                     **config)
    print()
    print(result.markdown)
    print()
    print("\n".join(lines))
    if result.tracking_unsent:  # the comparison is complete; its MLflow runs are not, until rayfl sync
        print(result.tracking_unsent, file=sys.stderr)
    return 0
