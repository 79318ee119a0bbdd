"""FedAvg's server on hand-made uploads: the average is weighted by training-set size (McMahan et al. 2017)."""

import numpy as np

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
