"""rayfl on the benchmark workload through its public path (config -> prepare -> launch, default placement).
Prints one JSON line: the driver's wall-clock time at the end of every round (evaluation and logging
included) and the start-up time from this process's start to the end of the first round."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

T0 = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    from workload import worker_args

    args = worker_args(**{"--set": {"action": "append", "default": [], "metavar": "KEY=VALUE", "help": "extra config values"},
                          "--no-mlflow": {"action": "store_true", "help": "no tracking at all (to measure its cost)"}})
    from workload import config_values

    from rayfl.actors.launch import launch
    from rayfl.flags import parse_params
    from rayfl.session import init_ray, shutdown_ray
    from rayfl.config import make_config
    from rayfl.experiment import prepare
    from rayfl.tracking import ensure_experiment

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        values = {**config_values(args.workload, args.data_root, args.rounds, uri), **parse_params(args.set)}
        prepared = prepare(make_config(None, values))
        init_ray(None)
        exp = ensure_experiment(uri, "bench-peers")
        stamps: list[float] = []
        tracking = None if args.no_mlflow else {"tracking_uri": uri, "experiment_id": exp, "run_name": args.workload}
        out = launch(prepared, tracking,
                     on_round=lambda rec: stamps.append(rec["time"]))
        shutdown_ray()
    print("RESULT " + json.dumps({"stamps": stamps, "startup": stamps[0] - T0,
                                  "acc": out["final"].get("test_acc_mean")}), flush=True)


if __name__ == "__main__":
    main()
