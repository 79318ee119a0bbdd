"""FedAvg's server on hand-made uploads (the average is weighted by training-set size, McMahan et al. 2017); the
size-weighted mean of scalars; FedAvg-FT's knobs and stage."""

import numpy as np
import pytest

from rayfl.algorithms.base import NoParams, RunInfo, Stage
from rayfl.algorithms.baselines import FedAvgServer
from rayfl.reduce import reduce_uploads


def test_fedavg_weights_uploads_by_training_size():
    info = RunInfo(n_clients=3, rounds=1, participation=1.0, seed=0, n_train=[10, 30, 60])
    srv = FedAvgServer(NoParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                       initial=np.zeros(2, np.float32))
    vecs = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [3.0, 3.0]}
    sizes = {0: 10, 1: 30, 2: 60}

    def call(step, msgs, reduce=None):  # the reduction the engine would run inside the client actors
        return reduce_uploads(reduce, {c: {"weights": np.array(vecs[c], np.float32), "n": sizes[c],
                                           "train_loss": float(c)} for c in msgs})

    metrics = srv.run_round(Stage("train", 1), 0, [0, 1, 2], call)
    # (10·(1,0) + 30·(0,1) + 60·(3,3)) / 100 = (1.9, 2.1); the plain mean would be (4/3, 4/3)
    np.testing.assert_allclose(srv.global_ref, [1.9, 2.1], rtol=1e-6)
    assert metrics["train_loss"] == (0 * 10 + 1 * 30 + 2 * 60) / 100


def test_weighted_mean_leaves_out_empty_and_nan_uploads():
    from rayfl.algorithms.common import weighted_mean

    ups = {0: {"loss": 1.0, "n": 1}, 1: {"loss": 4.0, "n": 2}, 2: {"loss": float("nan"), "n": 5},
           3: {"loss": 9.0, "n": 0}, 4: {"loss": 7.0}}
    # only clients 0 and 1 count: (1·1 + 2·4) / 3 = 3 (NaN, n = 0 and a missing n are left out)
    assert weighted_mean(ups, "loss") == 3.0
    assert np.isnan(weighted_mean({0: {"loss": 2.0, "n": 0}}, "loss"))  # nothing left: NaN, not an error
    assert np.isnan(weighted_mean({}, "loss"))


def test_finetune_params_and_stage():
    from rayfl.algorithms.baselines import FineTuneClient, FineTuneParams, FineTuneServer

    FineTuneParams(ft_epochs=1, ft_lr=0.0).check(2)
    with pytest.raises(ValueError, match="ft_epochs=0"):
        FineTuneParams(ft_epochs=0).check(2)
    with pytest.raises(ValueError, match="ft_lr=-0.1"):
        FineTuneParams(ft_lr=-0.1).check(2)
    info = RunInfo(n_clients=4, rounds=3, participation=0.5, seed=0, n_train=[1] * 4)
    srv = FineTuneServer(FineTuneParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                         initial=np.zeros(2, np.float32))
    fedavg, finetune = srv.stages()
    assert (fedavg.name, fedavg.rounds, finetune.name, finetune.rounds) == ("fedavg", 3, "finetune", 1)
    assert finetune.sample is False  # every client fine-tunes, whatever the participation of the FedAvg rounds

    class Fake:  # records what the fine-tuning step asks of its client
        def load(self, vec):
            self.loaded = vec

        def fit(self, epochs=None, lr=None):
            self.fit_args = (epochs, lr)
            return {"train_loss": 0.0, "n": 1}

    for ft_lr, lr in ((0.0, None), (0.25, 0.25)):  # 0: the run's lr (None), else ft_lr
        c = Fake()
        FineTuneClient(FineTuneParams(ft_epochs=3, ft_lr=ft_lr)).step_finetune(c, {}, {"global": "g"})
        assert c.loaded == "g" and c.fit_args == (3, lr)


def test_finetune_evaluates_the_global_model_then_each_clients_own():
    from rayfl.algorithms.baselines import FineTuneParams, FineTuneServer

    info = RunInfo(n_clients=2, rounds=1, participation=1.0, seed=0, n_train=[1, 1])
    srv = FineTuneServer(FineTuneParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                         initial=np.zeros(2, np.float32))
    fedavg, finetune = srv.stages()
    assert srv.eval_messages(fedavg, 0, [0, 1]) == {c: {"models": {"global": srv.global_ref}} for c in (0, 1)}
    assert srv.eval_messages(finetune, 1, [0, 1]) == {0: {}, 1: {}}  # the fine-tuned personal models
