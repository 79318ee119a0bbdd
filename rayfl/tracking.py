"""MLflow tracking as a loop callback: the only place in rayfl that calls MLflow during a run.

One MLflow run per experiment (a child of a sweep's parent run under Tune): every resolved config value
as a param, per-round metrics with ``step=round``, per-client metrics, and artifacts (config, placement,
per-client results, round history, final weights, plots, and whatever the algorithm keeps, such as
FedFomo's P matrix every round).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile

import numpy as np
import pandas as pd
import yaml

from rayfl.loop import Callback

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(uri: str | None) -> str:
    """The flag, else MLFLOW_TRACKING_URI, else a local sqlite file; local paths made absolute
    so that actors whose working directory differs write to the same store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def ensure_experiment(uri: str, name: str) -> str:
    """Experiment id for ``name``, created if missing (in the calling process, so that its artifact
    location is resolved against the user's working directory)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(name)
    return exp.experiment_id if exp else mlflow.create_experiment(name)


def numeric(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
            and math.isfinite(float(v))}


class MlflowTracker(Callback):
    def __init__(self, tracking_uri: str, experiment_id: str, run_name: str | None = None,
                 parent_run_id: str | None = None, extra_params: dict | None = None):
        self.uri = tracking_uri
        self.experiment_id = experiment_id
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.extra_params = extra_params or {}
        self.run_id: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="rayfl-artifacts-")

    # --- helpers --------------------------------------------------------------------------------
    def _log_array(self, name: str, array, artifact_path: str) -> None:
        import mlflow

        path = os.path.join(self._tmp, name)
        np.save(path, np.asarray(array))
        mlflow.log_artifact(path, artifact_path)

    def _log_object(self, name: str, obj, path: str) -> None:
        import mlflow

        if isinstance(obj, pd.DataFrame):
            local = os.path.join(self._tmp, f"{name}.csv")
            obj.to_csv(local, index=False)
            mlflow.log_artifact(local, path)
        elif isinstance(obj, dict):
            mlflow.log_dict(obj, f"{path}/{name}.json")
        elif hasattr(obj, "savefig"):
            mlflow.log_figure(obj, f"{path}/{name}.png")
        else:
            self._log_array(f"{name}.npy", obj, path)
            arr = np.asarray(obj)
            if arr.ndim == 2 and arr.shape[0] == arr.shape[1] and arr.shape[0] > 1:
                from rayfl.plots import heatmap

                mlflow.log_figure(heatmap(arr, name), f"plots/{name}.png")

    # --- callback hooks -------------------------------------------------------------------------
    def on_start(self, loop) -> None:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        resume_file = os.path.join(loop.checkpoint_dir, "mlflow_run_id") if loop.checkpoint_dir else None
        if loop.start_step > 0 and resume_file and os.path.isfile(resume_file):
            run = mlflow.start_run(run_id=open(resume_file).read().strip())
        else:
            run = mlflow.start_run(experiment_id=self.experiment_id, run_name=self.run_name,
                                   parent_run_id=self.parent_run_id)
            cfg = loop.cfg
            params = {**cfg.to_flat(), "model_resolved": loop.prepared.model_spec.name,
                      "n_params": loop.prepared.info.n_params, "n_actors": len(loop.runtime.placement()),
                      **self.extra_params}
            mlflow.log_params({k: ("" if v is None else v) for k, v in params.items()})
            mlflow.log_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), "config.yaml")
            mlflow.log_dict({"placement": loop.runtime.placement()}, "placement.json")
            mlflow.log_table(pd.DataFrame({"client": range(cfg.clients), "n_train": loop.prepared.info.n_train,
                                           "group": loop.prepared.info.groups or [None] * cfg.clients}),
                             "results/clients.json")
        self.run_id = run.info.run_id
        if resume_file:
            os.makedirs(loop.checkpoint_dir, exist_ok=True)
            with open(resume_file, "w") as f:
                f.write(self.run_id)

    def on_setup(self, loop) -> None:
        import mlflow

        if loop.setup_metrics:
            mlflow.log_metrics({f"setup/{k}": v for k, v in numeric(loop.setup_metrics).items()}, step=0)

    def on_round(self, loop, record) -> None:
        import mlflow

        metrics = numeric(record.metrics)
        metrics["participants"] = len(record.participants)
        for cid, rec in record.per_client.items():
            for k, v in numeric(rec).items():
                if not k.startswith("n_") and k != "seconds":
                    metrics[f"client/{cid}/{k}"] = v
        mlflow.log_metrics(metrics, step=record.step)
        for name, arr in loop.server.round_artifacts(record.step).items():
            self._log_array(f"{name}_{record.step:04d}.npy", arr, f"rounds/{name}")

    def on_end(self, loop) -> None:
        import mlflow

        from rayfl.plots import accuracy_plot

        info = loop.prepared.info
        table = pd.DataFrame([{"client": c, "n_train": info.n_train[c],
                               "group": info.groups[c] if info.groups else None, **rec}
                              for c, rec in sorted(loop.last_eval.items())])
        self._log_object("per_client", table, "results")
        self._log_object("rounds", pd.DataFrame(loop.history), "results")
        final = loop.server.final_model()
        if final is not None:
            self._log_array("global.npy", loop.runtime.get([final])[0], "models")
        vectors = loop.runtime.client_vectors()
        path = os.path.join(self._tmp, "clients.npz")
        np.savez_compressed(path, **{f"client_{c}": v for c, v in sorted(vectors.items())})
        mlflow.log_artifact(path, "models")
        mlflow.log_figure(accuracy_plot(loop.history), "plots/accuracy.png")
        for name, obj in loop.server.artifacts().items():
            self._log_object(name, obj, "algorithm")
        mlflow.log_metrics({f"final_{k}": v for k, v in numeric(loop.final).items()})
        mlflow.end_run()

    def fail(self, status: str = "FAILED") -> None:
        """Close the run as FAILED (or KILLED when stopped on request), keeping all logged so far."""
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run(status=status)
