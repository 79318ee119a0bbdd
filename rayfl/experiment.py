"""What an experiment is made of before its first round: data, federation, model and initial weights.

Built once, in the process that submits the run, so that every user mistake (a bad partition, a
missing data root) is reported before any actor starts, and the data is loaded exactly once. Reading a
:class:`Prepared` does not import torch: a driver whose algorithm's server needs none (FedAvg) starts its
MLflow work about 2 s sooner.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfl.algorithms import get_algorithm
from rayfl.algorithms.base import Algorithm, RunInfo
from rayfl.config import Config, UserError


@dataclass(frozen=True)
class ModelSpec:
    """How to build the experiment's network anywhere: name and the dataset's shape, and a registered model's
    factory, which travels with the spec to processes where the model was not registered."""

    name: str
    input_shape: tuple
    num_outputs: int
    factory: Any = None

    def build(self):
        from rayfl.models import build_model

        return build_model(self.name, self.input_shape, self.num_outputs, self.factory)


@dataclass(frozen=True)
class HostSpec:
    """What a client host (:class:`rayfl.host.ClientHost`) needs to build its clients, in whatever process it
    runs: the run's config, the algorithm and its knobs as parsed once (:meth:`rayfl.config.Config.check`), how
    to build the network, the data every client's splits index into, the common initial weights and the
    held-out set. Under Ray the arrays travel beside it as object-store references (:meth:`without_arrays`)."""

    cfg: Config
    algorithm: Algorithm
    params: Any
    model_spec: ModelSpec
    task: str
    x: Any = None
    y: Any = None
    initial: Any = None
    holdout: Any = None

    def without_arrays(self) -> "HostSpec":
        """The spec less its data and initial weights, which travel apart (one object-store copy per cluster)."""
        return dataclasses.replace(self, x=None, y=None, initial=None)

    def with_arrays(self, x, y, initial) -> "HostSpec":
        return dataclasses.replace(self, x=x, y=y, initial=initial)


@dataclass
class Prepared:
    cfg: Config
    algorithm: Algorithm
    params: Any  # the algorithm's knobs (its Params), parsed and checked once, by cfg.check()
    dataset: object  # rayfl.data.Dataset
    federation: object  # rayfl.data.Federation
    model_spec: ModelSpec
    initial: np.ndarray
    info: RunInfo
    data_id: str = ""  # digest of the data and splits, when stages are shared (rayfl.stage_cache)
    # what was registered from outside the package (rayfl.plugins.Plugins): every process that receives this
    # registers it on arrival, so that a plugin's algorithm is found by name there too
    plugins: object = None

    def host_spec(self) -> HostSpec:
        """What every host of this run builds its clients from."""
        return HostSpec(self.cfg, self.algorithm, self.params, self.model_spec, self.info.task, self.dataset.x,
                        self.dataset.y, self.initial, self.federation.holdout)


def prepare(cfg: Config) -> Prepared:
    import torch

    from rayfl.data import build_federation, load_dataset
    from rayfl.models import check_model, default_model
    from rayfl.models import registered as registered_models
    from rayfl.stage_cache import data_identity
    from rayfl.training import to_vector

    params = cfg.check()
    if cfg.stage_cache:  # the same directory for every process of the run, whatever its working directory
        cfg.stage_cache = os.path.abspath(os.path.expanduser(cfg.stage_cache))
        try:  # one that cannot be written is refused now, not when a stage is stored
            os.makedirs(cfg.stage_cache, exist_ok=True)
            with tempfile.TemporaryFile(dir=cfg.stage_cache):
                pass
        except OSError as e:
            raise UserError(f"stage_cache={cfg.stage_cache!r}: cannot write there ({e.strerror or e})") from None
    ds = load_dataset(cfg)
    fed = build_federation(cfg, ds)
    name = default_model(ds) if cfg.model == "auto" else cfg.model
    spec = ModelSpec(name, tuple(ds.input_shape), int(ds.num_classes), registered_models().get(name))
    torch.manual_seed(cfg.seed)
    try:
        model = spec.build()
        check_model(name, model, spec.input_shape, spec.num_outputs, cfg.dataset)
        initial = to_vector(model)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory may raise anything: one line
        raise UserError(f"model={name!r} does not fit dataset {cfg.dataset!r} of shape {ds.input_shape}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    groups = [c.group for c in fed.clients]
    info = RunInfo(n_clients=cfg.clients, rounds=cfg.rounds, participation=cfg.participation, seed=cfg.seed,
                   n_train=[len(c.train) for c in fed.clients], task=ds.task,
                   groups=groups if any(g is not None for g in groups) else None, n_params=int(initial.size),
                   holdout_counts=np.bincount(ds.y[fed.holdout], minlength=ds.num_classes).tolist()
                   if ds.task == "classification" else None, model=name)
    algorithm = get_algorithm(cfg.algo)
    check_run = getattr(params, "check_run", None)
    if check_run is not None:  # what the algorithm needs of the federation and the network, before any actor starts
        try:
            check_run(info, model)
        except ValueError as e:
            raise UserError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a plugin's check may raise anything: one line naming it
            raise UserError(f"algo={cfg.algo!r}: its Params.check_run raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if cfg.dp_noise > 0:
        from rayfl.privacy import check_model

        try:
            check_model(cfg, model, name)
        except ValueError as e:
            raise UserError(str(e)) from None
    data_id = data_identity(ds, fed) if cfg.stage_cache else ""
    from rayfl.plugins import carried

    return Prepared(cfg, algorithm, params, ds, fed, spec, initial, info, data_id, plugins=carried())
