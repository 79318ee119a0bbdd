"""The ``rayfl`` command: ``run`` one experiment, ``tune`` a sweep, ``compare`` algorithms x seeds, ``algos``.

User mistakes end in one line on stderr and exit status 2, before any actor starts. This is the argparse layer
only: each command's parsed flags become a typed request (:mod:`rayfl.specs`) run by the same entry point the
API uses (:func:`rayfl.api.run_spec`, :func:`rayfl.sweep.command.run_sweep`,
:func:`rayfl.comparison.run.compare_spec`); the config flags are :mod:`rayfl.flags`'s, the Ray session
:mod:`rayfl.session`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from rayfl.config import UserError, check_value, did_you_mean
from rayfl.flags import (add_config_arguments, add_session_arguments, config_flags_given, config_from_args,
                         parse_params)
from rayfl.session import RayStartError
from rayfl.user_input import mask_credentials


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (``rayfl: error: ...``, exit 2) like every other mistake, naming the
    nearest flag or command; a flag is never abbreviated (``--client`` is a mistake, not ``--clients``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        import re

        if message.startswith("unrecognized arguments: "):
            flags = [w.split("=")[0] for w in message.split()[2:] if w.startswith("-")]
            if flags:
                message += did_you_mean(flags[0], self._all_flags()).replace("'", "")
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            message += did_you_mean(choice.group(1), re.findall(r"[\w.-]+", choice.group(2)))
        raise UserError(message[len("argument "):] if message.startswith("argument ") else message)

    def _all_flags(self) -> list[str]:
        """This parser's flags and its subcommands' (argparse reports a subcommand's unknown flag here)."""
        flags = []
        for action in self._actions:
            flags += [o for o in action.option_strings if o.startswith("--")]
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._all_flags() if isinstance(sub, Parser) else []
        return sorted(set(flags))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rayfl", description="Personalized federated learning experiments on Ray, tracked in MLflow.",
        epilog="Examples:\n  rayfl run                                  # the embedded default (digits, ~1 min)\n"
               "  rayfl run --algo fedfomo -p M=5 -p epsilon=0.3\n"
               "  rayfl tune --algo persfl                   # a sweep over tune_spaces/persfl.yaml\n"
               "  mlflow ui --backend-store-uri sqlite:///mlflow.db   # then open http://127.0.0.1:5000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rayfl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run one experiment", description="Run one experiment and log it to MLflow.")
    add_config_arguments(run)
    add_session_arguments(run, resume="go on from the last checkpoint in a run directory")
    from rayfl.plugins import add_plugin_argument

    add_plugin_argument(sub.add_parser("algos", help="list algorithms, their knobs and the models"))
    sync = sub.add_parser("sync", help="send what a run kept for an unreachable tracking server",
                          description="Deliver the MLflow records a run kept in RUN_DIR/mlflow_outbox (its tracking "
                                      "server did not answer within tracking_wait) to the same MLflow run. What was "
                                      "delivered is recorded: a second sync sends nothing. A sweep's or a "
                                      "comparison's directory syncs each of its runs that kept records.")
    sync.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (or a sweep's, a comparison's)")
    sync.add_argument("--tracking-uri", help="the server to send to (default: the one the run used)")
    sync.set_defaults(handler=cmd_sync)
    from rayfl.sweep.command import add_tune_parser

    add_tune_parser(sub)
    from rayfl.comparison.command import add_compare_parser

    add_compare_parser(sub)
    return parser


def _version() -> str:
    from rayfl.provenance import version

    return version()


def cmd_algos() -> int:
    from rayfl.algorithms import algorithm_names, algorithm_source, get_algorithm
    from rayfl.models import MODELS

    for name in algorithm_names():
        algo = get_algorithm(name)
        knobs = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(algo.Params)) or "-"
        source = algorithm_source(name)
        print(f"{name:12s} {algo.summary}" + (f" [from {source}]" if source else "") + f"\n{'':12s} knobs: {knobs}")
    print("\nmodels:", ", ".join(MODELS))
    return 0


def cmd_run(args) -> int:
    """Arguments -> a :class:`rayfl.specs.RunSpec` -> :func:`rayfl.api.run_spec`; this prints, the API does the
    rest."""
    from rayfl.api import run_spec
    from rayfl.progress import ConsoleProgress, mlflow_hint, summary_table
    from rayfl.specs import RunSpec, check_resume

    given = config_flags_given(args)
    steps_only = all(item.partition("=")[0].strip().endswith("lr") for item in args.param)  # -p NAME_lr=VALUE
    resume = check_resume(args.resume, [g for g in given if not (g == "--param" and steps_only)], "run", "flag")
    steps = {**({"lr": args.lr} if getattr(args, "lr", None) is not None else {}),
             **({"params": parse_params(args.param)} if args.param else {})} if resume else {}
    spec = RunSpec(None if resume else config_from_args(args), resume, args.address, step_sizes=steps,
                   ui_port=args.ui_port)
    console = ConsoleProgress(rounds=not args.quiet)
    plan: dict = {}

    def show(event: dict) -> None:
        if event["event"] == "plan":
            plan.update(event)
        console(event)

    from rayfl.divergence import Diverged
    from rayfl.loop import Loop, NoCapacity

    try:
        result = run_spec(spec, progress=show)
    except (UserError, RayStartError):
        raise
    except KeyboardInterrupt:
        print(resume_hint(plan["cfg"], plan["run_dir"]) if plan else "rayfl: interrupted", file=sys.stderr)
        return 130
    except NoCapacity as e:  # client actors lost with their node, and no room came back: one line
        print(no_capacity_line(e), file=sys.stderr)
        return 1
    except Diverged as e:  # a loss or the model went non-finite: no result to report, the last finite checkpoint kept
        print(f"rayfl: {e}", file=sys.stderr)
        if plan and Loop.has_checkpoint(plan["run_dir"]):
            from rayfl.divergence import step_flag

            lower = step_flag("lr", plan["cfg"].lr / 2)
            print(f"rayfl: its last checkpoint, written before the divergence, is kept; go on from it with a lower "
                  f"step size: rayfl run --resume {plan['run_dir']} {lower}", file=sys.stderr)
        return 1
    except Exception as e:  # the run failed inside Ray: say what, and where its remains are
        print(f"rayfl: run failed: {mask_credentials(_root_cause(e))}", file=sys.stderr)
        if plan:
            uri = mask_credentials(plan["tracking_uri"])
            print(f"rayfl: what was logged is kept in MLflow ({uri}); checkpoints in "
                  f"{plan['run_dir']}", file=sys.stderr)
        return 1
    where = f" {result.final['round']}" + (f" ({result.final['stage']})" if "stage" in result.final else "")
    print(f"\nfinal round{where if 'round' in result.final else ''}, across clients:")
    print(summary_table(result.final, result.worst_test_samples, result.caveat))  # its caveats beside it
    print(f"\nMLflow run {result.run_id} in experiment {plan['cfg'].experiment!r} at {result.tracking_uri}")
    print(mlflow_hint(result.tracking_uri, result.experiment_id, result.run_id, port=args.ui_port))
    if result.tracking_unsent:  # the run is complete; its MLflow run is not, until rayfl sync
        print(result.tracking_unsent, file=sys.stderr)
    return 0


def cmd_sync(args) -> int:
    """``rayfl sync RUN_DIR``: what a run kept for an unreachable tracking server, to its MLflow run."""
    from rayfl.tracking import sync

    try:
        sync(args.run_dir, args.tracking_uri, say=print)
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - the store refused what it was sent, or stopped answering mid-way
        print(f"rayfl: sync failed: {mask_credentials(_root_cause(e))}; what was delivered is recorded: sync "
              f"again to send the rest", file=sys.stderr)
        return 1
    return 0


def no_capacity_line(e) -> str:
    """A run that lost client actors with their node and found no room for them: the cause, and how to go on."""
    if e.checkpoint is None:
        return f"rayfl: run stopped: {e}; no checkpoint to go on from (none was due yet)"
    directory, step = e.checkpoint
    return f"rayfl: run stopped: {e}; checkpoint of round {step + 1} kept: go on with: rayfl run --resume {directory}"


def resume_hint(cfg, run_dir: str) -> str:
    """What Ctrl-C leaves: how to go on, or why one cannot."""
    if cfg.checkpoint_every:
        return (f"rayfl: interrupted; go on from the last checkpoint (every {cfg.checkpoint_every} rounds) with: "
                f"rayfl run --resume {run_dir}")
    return ("rayfl: interrupted; this run kept no checkpoints (checkpoint_every=0): add --checkpoint-every N "
            "to be able to go on with --resume")


def _root_cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e.__cause__
    e = cause if cause is not None else e
    return f"{type(e).__name__}: {e}".splitlines()[0]


def check_arguments(argv: list[str]) -> None:
    """Every argument (a flag's value, a path, a name) bounded as config strings are, before argparse or
    anything else reads it: no NUL byte, at most MAX_TEXT characters. Named as the flag it follows."""
    for i, arg in enumerate(argv):
        flag, sep, value = str(arg).partition("=") if str(arg).startswith("--") else ("", "", str(arg))
        if not sep and i and str(argv[i - 1]).startswith("-") and not str(arg).startswith("-"):
            flag = str(argv[i - 1])
        name = flag.lstrip("-").replace("-", "_") if flag.startswith("--") else flag or "argument"
        check_value(name, value if sep else str(arg))


def main(argv=None) -> int:
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # not "Creating initial MLflow database tables..."
    parser = build_parser()
    try:
        check_arguments(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        if getattr(args, "ui_port", None) is not None:  # run, tune, compare: before anything starts
            from rayfl.specs import check_ui_port

            args.ui_port = check_ui_port(args.ui_port)
        if args.command in ("run", "tune", "compare"):  # the commands that start Ray: a Ray rayfl supports
            from rayfl.ray_compat import check_ray_version

            check_ray_version()
        if hasattr(args, "plugin"):  # entry points, $RAYFL_PLUGINS, --plugin: before anything reads a name
            from rayfl.plugins import load_plugins

            load_plugins(args.plugin)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "algos":
            return cmd_algos()
        return args.handler(args)
    except UserError as e:
        print(f"rayfl: error: {e}", file=sys.stderr)
        return 2
    except RayStartError as e:
        print(f"rayfl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rayfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
