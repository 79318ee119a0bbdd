"""The ``rayfl compare`` subcommand: the flags of ``rayfl run`` plus --algos, --seeds and --preset."""

from __future__ import annotations

import sys

from rayfl.config import FIELDS, UserError, read_yaml, shown
from rayfl.flags import add_config_arguments, add_options, add_session_arguments, parse_params
from rayfl.specs import CompareOptions, CompareSpec


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
    add_options(g, CompareOptions)
    add_session_arguments(g)
    p.set_defaults(handler=cmd_compare)


def cmd_compare(args) -> int:
    """``rayfl compare``: the parsed flags as a :class:`rayfl.specs.CompareSpec`, run by
    :func:`rayfl.comparison.run.compare_spec` (as :func:`rayfl.compare` runs one); the table printed."""
    from rayfl.comparison.run import compare_spec
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
    seeds = args.seeds or ([config["seed"]] if "seed" in config else list(CompareOptions.seeds))
    algos = [a.strip() for a in args.algos.split(",") if a.strip()] if args.algos else None
    if args.algos is not None and not algos:
        raise UserError(f"--algos {args.algos!r}: expected A,B,...")
    lines: list[str] = []  # the closing MLflow lines come after the table
    spec = CompareSpec(algos=algos, seeds=seeds, preset=args.preset, max_concurrent=args.max_concurrent,
                       runtime=args.runtime, name=args.name, params=params, config=config, address=args.address,
                       ui_port=args.ui_port,
                       progress=lambda line: (lines.append(line) if line.startswith("look at it") or
                                              line.startswith("  then") else print(line, flush=True)))
    show = None if args.quiet else (lambda label, rec: print(f"{label:>14s}  {format_round(rec)}", flush=True))
    result = compare_spec(spec, on_round=show)
    print()
    print(result.markdown)
    print()
    print("\n".join(lines))
    if result.tracking_unsent:  # the comparison is complete; its MLflow runs are not, until rayfl sync
        print(result.tracking_unsent, file=sys.stderr)
    return 0
