"""The ``rayfl`` command: ``run`` one experiment, ``tune`` a sweep, ``compare`` algorithms x seeds, ``algos``.

User mistakes end in one line on stderr and exit status 2, before any actor starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from rayfl.config import FIELDS, UserError, make_config

# Flag help, grouped as the help screen shows them. Every Config field is a flag (dashes for underscores).
GROUPS = {
    "what runs": {
        "algo": "algorithm (see `rayfl algos`)",
        "dataset": "digits (offline default) | mnist | fashion-mnist | cifar10 | cifar100 | synthetic | sine",
        "data_root": "directory holding the dataset's files (MNIST IDX files work directly)",
        "download": "allow torchvision to download the dataset (needs network)",
        "model": "network; auto picks one for the dataset (see `rayfl algos`)",
    },
    "how the data is split": {
        "partition": "iid | pathological | dirichlet | latent | majority | label-groups | rotation | permutation",
        "classes_per_client": "classes per client (pathological)",
        "alpha": "Dirichlet concentration (dirichlet)",
        "groups": "number of latent / label / rotation / permutation groups",
        "group_assign": "clients to groups: blocks | random | auto (label-groups random, others blocks)",
        "label_shift": "Dirichlet alpha of a label shift on top of rotation / permutation groups (0: none)",
        "majority": "majority-class fraction p (majority)",
        "sizes": "client dataset sizes: equal | lognormal",
        "size_sigma": "sigma of the log-normal sizes",
        "samples_per_client": "cap on each client's samples (0: divide the whole dataset)",
        "val_frac": "validation fraction of each client's data",
        "test_frac": "test fraction of each client's data",
        "ood": "swap (validation, test) pairs among clients (FedFomo's out-of-distribution setting)",
    },
    "federation and local training": {
        "clients": "number of clients",
        "rounds": "communication rounds (stages such as fine-tuning add their own)",
        "participation": "fraction of clients sampled each round, in (0, 1]",
        "local_epochs": "local epochs per round",
        "lr": "learning rate",
        "batch_size": "minibatch size",
        "optimizer": "sgd | adam",
        "momentum": "SGD momentum",
        "weight_decay": "weight decay",
        "seed": "seed of the partition, initialisation, sampling and training",
    },
    "evaluation, tracking, keeping": {
        "eval_every": "evaluate every client every N rounds (the last round always)",
        "client_metrics": "per-client values also as MLflow metrics for up to N clients (always as a table)",
        "checkpoint_every": "checkpoint every N rounds (0: never); resume with --resume DIR",
        "out_dir": "where run directories (config, checkpoints) go",
        "tracking_uri": "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
        "experiment": "MLflow experiment name",
        "run_name": "MLflow run name",
    },
    "resources": {
        "clients_per_actor": "clients hosted by one client actor (auto: one actor per client while the "
                             "cluster has a CPU share or GPU slice for each, else clients spread evenly)",
        "cpus_per_actor": "CPUs reserved per client actor (0: an even share of the cluster)",
        "gpus_per_actor": "GPUs per client actor, fractional allowed (-1: automatic share)",
        "torch_threads": "torch threads per client actor",
    },
}
assert {k for g in GROUPS.values() for k in g} == set(FIELDS) - {"params"}, "every Config field needs help"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Every Config field as a flag whose default is 'not given', so a --config file is only overridden
    by what the user typed."""
    parser.add_argument("--config", metavar="FILE", help="YAML file of config keys; flags override it")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="an algorithm knob, e.g. -p epsilon=0.3 -p M=5 (see `rayfl algos`)")
    for title, fields in GROUPS.items():
        group = parser.add_argument_group(title)
        for name, text in fields.items():
            default = FIELDS[name].default
            flag = "--" + name.replace("_", "-")
            if isinstance(default, bool):
                group.add_argument(flag, action="store_true", default=argparse.SUPPRESS,
                                   help=f"{text}")
            else:
                metavar = {int: "N", float: "X"}.get(type(default), name.split("_")[-1].upper())
                metavar = "N|auto" if name == "clients_per_actor" else metavar
                group.add_argument(flag, default=argparse.SUPPRESS, metavar=metavar,
                                   help=f"{text} (default: {default})")


def parse_params(items: list[str]) -> dict:
    """``-p KEY=VALUE`` flags as a dict, values read as YAML scalars (0.3 -> float, [1, 2] -> list)."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param {item!r}: expected KEY=VALUE")
        params[key.strip()] = _parse_scalar(value.strip())
    return params


def config_from_args(args: argparse.Namespace):
    overrides = {k: v for k, v in vars(args).items() if k in FIELDS}
    params = parse_params(args.param)
    if params:
        overrides["params"] = params
    return make_config(args.config, overrides)


def _parse_scalar(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayfl", description="Personalized federated learning experiments on Ray, tracked in MLflow.",
        epilog="Examples:\n  rayfl run                                  # the embedded default (digits, ~1 min)\n"
               "  rayfl run --algo fedfomo -p M=5 -p epsilon=0.3\n"
               "  rayfl tune --algo persfl                   # a sweep over tune_spaces/persfl.yaml\n"
               "  mlflow ui --backend-store-uri sqlite:///mlflow.db   # then open http://127.0.0.1:5000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run one experiment", description="Run one experiment and log it to MLflow.")
    add_config_arguments(run)
    run.add_argument("--resume", metavar="DIR", help="go on from the last checkpoint in a run directory")
    run.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance)")
    run.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    sub.add_parser("algos", help="list algorithms, their knobs and the models")
    try:
        from rayfl.sweep import add_tune_parser
    except ModuleNotFoundError as e:
        if e.name != "rayfl.sweep":
            raise
    else:
        add_tune_parser(sub, add_config_arguments)
    from rayfl.compare.command import add_compare_parser

    add_compare_parser(sub, add_config_arguments)
    return parser


def init_ray(address: str | None) -> None:
    """Connect to the given cluster, or start a private local instance (never someone else's)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance needs no token
    ray.init(address=address or "local", include_dashboard=False if not address else None,
             logging_level="ERROR", configure_logging=True, log_to_driver=True)


def cmd_algos() -> int:
    from rayfl.algorithms import algorithm_names, get_algorithm
    from rayfl.models import MODELS

    for name in algorithm_names():
        algo = get_algorithm(name)
        knobs = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(algo.Params)) or "-"
        print(f"{name:12s} {algo.summary}\n{'':12s} knobs: {knobs}")
    print("\nmodels:", ", ".join(MODELS))
    return 0


def format_round(rec: dict) -> str:
    m = rec["metrics"]
    parts = [f"round {rec['step'] + 1:>3}/{rec['total']} [{rec['stage']}]"]
    if "test_acc_mean" in m:
        parts.append(f"test acc {m['test_acc_mean']:.3f} (worst {m['test_acc_worst']:.3f})")
    elif "test_loss_mean" in m:
        parts.append(f"test loss {m['test_loss_mean']:.4f}")
    if "val_acc_mean" in m:
        parts.append(f"val acc {m['val_acc_mean']:.3f}")
    if m.get("train_loss") == m.get("train_loss") and "train_loss" in m:
        parts.append(f"train loss {m['train_loss']:.3f}")
    parts.append(f"{m['round_seconds']:.2f}s")
    return "  ".join(parts)


def summary_table(final: dict) -> str:
    extra = sorted(k[:-5] for k in final if k.endswith("_acc_mean") and k[:-5] not in ("test_acc", "val_acc"))
    metrics = [m for m in ("test_acc", "val_acc", "test_loss", *extra) if f"{m}_mean" in final]  # FedMoE's too
    width = max([10, *(len(m) + 2 for m in metrics)])
    stats = ("mean", "weighted_mean", "std", "worst", "bottom10_mean")
    rows = [f"{m:{width}s}" + "".join(f"{final.get(f'{m}_{s}', float('nan')):>12.4f}" for s in stats) for m in metrics]
    head = f"{'':{width}s}" + "".join(f"{h:>12s}" for h in ("mean", "weighted", "std", "worst", "bottom10%"))
    return "\n".join([head, *rows])


def cmd_run(args) -> int:
    from rayfl.config import read_yaml

    if args.resume:
        saved = os.path.join(args.resume, "config.yaml")
        if not os.path.isfile(saved):
            raise UserError(f"--resume {args.resume!r}: no config.yaml there (not a rayfl run directory)")
        cfg = make_config(None, read_yaml(saved))
        run_dir = args.resume
    else:
        cfg = config_from_args(args)
    from rayfl.experiment import prepare
    from rayfl.tracking import ensure_experiment, resolve_tracking_uri

    prepared = prepare(cfg)  # every user mistake surfaces here, before Ray starts
    uri = resolve_tracking_uri(cfg.tracking_uri)
    exp_id = ensure_experiment(uri, cfg.experiment)
    run_name = cfg.run_name or f"{cfg.algo}-{cfg.dataset}-{cfg.partition}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not args.resume:
        run_dir = os.path.abspath(os.path.join(cfg.out_dir, run_name))
        os.makedirs(run_dir, exist_ok=True)
        import yaml

        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump({**dataclasses.asdict(cfg), "run_name": run_name}, f, sort_keys=False)
    print(f"rayfl: {cfg.algo} on {cfg.dataset} ({cfg.partition}), {cfg.clients} clients, "
          f"{prepared.info.n_params} parameters ({prepared.model_spec.name}); run directory {run_dir}", flush=True)

    init_ray(args.address)
    from rayfl.actors.launch import launch

    show = None if args.quiet else (lambda rec: print(format_round(rec), flush=True))
    tracking = {"tracking_uri": uri, "experiment_id": exp_id, "run_name": run_name}
    try:
        result = launch(prepared, tracking, checkpoint_dir=run_dir, on_round=show,
                        cluster_may_grow=bool(args.address or os.environ.get("RAY_ADDRESS")))
    except UserError:
        raise
    except Exception as e:  # the run failed inside Ray: say what, and where its remains are
        print(f"rayfl: run failed: {_root_cause(e)}", file=sys.stderr)
        print(f"rayfl: what was logged is kept in MLflow ({uri}); checkpoints in {run_dir}", file=sys.stderr)
        return 1
    finally:
        import ray

        ray.shutdown()
    print("\nfinal round, across clients:")
    print(summary_table(result["final"]))
    print(f"\nMLflow run {result['run_id']} in experiment {cfg.experiment!r} at {uri}")
    print(f"look at it: mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000)")
    return 0


def _root_cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e.__cause__
    e = cause if cause is not None else e
    return f"{type(e).__name__}: {e}".splitlines()[0]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "run":
            return cmd_run(args)
        if args.command == "algos":
            return cmd_algos()
        return args.handler(args)
    except UserError as e:
        print(f"rayfl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rayfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
