"""LG-FedAvg (Liang et al. 2020): the top layers are the global model, the bottom ones each device's local
representation; the FedAvg warm start and its hand-over; which model is evaluated; runs through the real loop.
The machinery LG-FedAvg shares with FedPer (SplitClient, with_shared, the size-weighted average) is tested in
tests/unit/test_fedper.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny
from test_fedper import five_layers, three_layers, two_layers  # the same small nets
from rayfl import training
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.lgfedavg import LGFedAvgClient, LGFedAvgParams, LGFedAvgServer, global_mask
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime


# ------------------------------------------------------------------------------------------- the split

def test_the_global_model_is_the_top_g_layers():
    np.testing.assert_array_equal(global_mask(two_layers(), 1), [False] * 6 + [True] * 6)
    np.testing.assert_array_equal(global_mask(three_layers(), 1), [False] * 15 + [True] * 4)
    np.testing.assert_array_equal(global_mask(three_layers(), 2), [False] * 6 + [True] * 13)
    # 0: the default, the top 2 capped at L - 1
    np.testing.assert_array_equal(global_mask(two_layers(), 0), [False] * 6 + [True] * 6)
    np.testing.assert_array_equal(global_mask(three_layers(), 0), [False] * 6 + [True] * 13)
    np.testing.assert_array_equal(global_mask(five_layers(), 0), [False] * 6 + [True] * 4)
    np.testing.assert_array_equal(global_mask(five_layers(), LGFedAvgParams().global_layers), [False] * 6 + [True] * 4)


def test_params_check_rejects_bad_values():
    LGFedAvgParams().check(3)
    LGFedAvgParams(global_layers=3, fedavg_rounds=7).check(3)
    for bad in (-1, 1.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="global_layers="):
            LGFedAvgParams(global_layers=bad).check(3)
        with pytest.raises(ValueError, match="fedavg_rounds="):
            LGFedAvgParams(fedavg_rounds=bad).check(3)


def test_check_config_and_the_split():
    from rayfl.config import UserError

    LGFedAvgParams(fedavg_rounds=1).check_config(tiny(algo="lg-fedavg", rounds=2))
    prepare(tiny(algo="lg-fedavg", dataset="digits", model="lenet5", params={"global_layers": 4}))
    with pytest.raises(ValueError, match="fedavg_rounds=2: must be below rounds=2"):
        LGFedAvgParams(fedavg_rounds=2).check_config(tiny(algo="lg-fedavg", rounds=2))
    with pytest.raises(UserError, match="global_layers=2: model 'mlp-small' has 2 layers, so at most 1"):
        prepare(tiny(algo="lg-fedavg", params={"global_layers": 2}))
    with pytest.raises(UserError, match="model='sine-mlp': has 1 layer; LG-FedAvg needs at least 2"):
        prepare(tiny(algo="lg-fedavg", dataset="sine", partition="iid"))


# ------------------------------------------------------------------------------------------- the server

def server(params, n=3, rounds=5):
    info = RunInfo(n_clients=n, rounds=rounds, participation=1.0, seed=0, n_train=[1] * n)
    return LGFedAvgServer(params, info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                          initial=np.zeros(2, np.float32))


def recording_call(log):
    def call(step, messages, reduce=None):
        log.append((step, {c: dict(m) for c, m in messages.items()}))
        return reduce_uploads(reduce, {c: {"weights": np.full(2, float(c + 1), np.float32), "n": 1,
                                           "train_loss": 0.0} for c in messages} if step == "train" else {})
    return call


def test_stages_a_fedavg_warm_start_out_of_the_runs_rounds():
    (lg,) = server(LGFedAvgParams()).stages()
    assert (lg.name, lg.rounds, lg.sample) == ("lg", 5, True)
    warm, lg = server(LGFedAvgParams(fedavg_rounds=3)).stages()
    assert (warm.name, warm.rounds, warm.depends_on, lg.name, lg.rounds) == ("fedavg", 3, (), "lg", 2)


def test_every_device_takes_the_last_fedavg_model_when_lg_fedavg_starts():
    srv = server(LGFedAvgParams(fedavg_rounds=2))
    warm, lg = srv.stages()
    log = []
    for rnd, stage in enumerate([warm, warm, lg, lg, lg]):
        before = srv.global_ref
        srv.run_round(stage, rnd, [0, 2], recording_call(log))
        if rnd == 1:
            fedavg_final = srv.global_ref
    assert [step for step, _ in log] == ["train", "train", "adopt", "train", "train", "train"]
    step, adopt = log[2]
    assert sorted(adopt) == [0, 1, 2]  # every device, not only the round's participants
    assert all(m["models"]["global"] is fedavg_final for m in adopt.values())
    assert [m["fedavg"] for _, ms in log if _ == "train" for m in ms.values()] == [True] * 4 + [False] * 6
    np.testing.assert_allclose(before, [2.0, 2.0])  # FedAvg's mean of the two uploads, (1 + 3) / 2
    assert srv.eval_messages(warm, 1, [0, 1]) == {c: {"models": {"global": srv.global_ref}, "fedavg": True}
                                                  for c in (0, 1)}
    assert srv.eval_messages(lg, 2, [1])[1]["fedavg"] is False


def test_no_hand_over_without_a_warm_start():
    srv = server(LGFedAvgParams())
    (lg,) = srv.stages()
    log = []
    for rnd in range(3):
        srv.run_round(lg, rnd, [0, 1], recording_call(log))
    assert [step for step, _ in log] == ["train"] * 3


# ------------------------------------------------------------------------------------------- the client

IDENTITY, SWAP, ZERO = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 6


def crafted_client(lr=0.1):
    """x = (a, -a), y = [a > 0]. A base W1 = I under the head W2 = [[0, 1], [1, 0]] is always right; W2 = I is
    always wrong; a zero base gives logits 0 (class 0, half right)."""
    a = torch.tensor([1.0, -2.0, 3.0, -1.0, 2.0, -3.0])
    x, y = torch.stack([a, -a], 1), (a > 0).long()
    return Client(0, {"train": (x, y), "val": (x, y), "test": (x, y)}, two_layers, None,
                  TrainSettings("classification", 1, lr, 4), 0)


def acc(vec, c):
    return training.evaluate(training.load_vector(two_layers(), vec), *c.splits["test"], "classification")[1]


def test_a_device_is_evaluated_on_its_local_layers_under_the_global_head():
    c = crafted_client()
    own = np.array(IDENTITY + IDENTITY, np.float32)  # its representation right, its stale head wrong
    glob = np.array(ZERO + SWAP, np.float32)  # the global head right, the averaged local entries broken
    c.set_weights(own)
    gen_state = c.gen.get_state()
    rec = LGFedAvgClient(LGFedAvgParams()).step_evaluate(c, {"fedavg": False}, {"global": glob})
    assert rec["test_acc"] == 1.0
    assert (acc(own, c), acc(glob, c)) == (0.0, 0.5)  # what the device's own or the global model would score
    np.testing.assert_array_equal(c.weights(), own)
    assert torch.equal(c.gen.get_state(), gen_state) and c.state == {}
    # during the warm start, FedAvg's evaluation: the global model itself
    rec = LGFedAvgClient(LGFedAvgParams()).step_evaluate(c, {"fedavg": True}, {"global": glob})
    assert rec["test_acc"] == 0.5


def test_a_device_takes_the_global_head_and_keeps_its_local_layers():
    c = crafted_client(lr=0.0)  # no training: what the step keeps is what it received
    own = np.array(IDENTITY + IDENTITY, np.float32)
    glob = np.array(ZERO + SWAP, np.float32)
    c.set_weights(own)
    up = LGFedAvgClient(LGFedAvgParams()).step_train(c, {"fedavg": False}, {"global": glob})
    np.testing.assert_array_equal(c.weights(), IDENTITY + SWAP)
    np.testing.assert_array_equal(up["weights"], IDENTITY + SWAP)
    assert up["n"] == 6


def test_the_warm_start_is_fedavg_and_the_hand_over_takes_the_whole_model():
    logic = LGFedAvgClient(LGFedAvgParams())
    c = crafted_client(lr=0.5)
    glob = np.array(IDENTITY + IDENTITY, np.float32)
    up = logic.step_train(c, {"fedavg": True}, {"global": glob})
    assert c.weights() is None  # FedAvg's client trains a working copy and keeps no model of its own
    assert not np.array_equal(up["weights"], glob) and up["n"] == 6
    assert logic.step_adopt(c, {}, {"global": glob}) == {}
    np.testing.assert_array_equal(c.weights(), glob)


# ------------------------------------------------------------------------------------------- the real loop

KW = dict(clients=4, rounds=5, partition="pathological", classes_per_client=2, participation=0.75)


def run(algo, **kw):
    p = prepare(tiny(algo=algo, **{**KW, **kw}))
    return p, Loop(p, LocalRuntime(p)).run()


def test_lg_fedavg_learns_local_representations_through_the_loop():
    _, lg = run("lg-fedavg")
    _, fedavg = run("fedavg")
    acc_lg = lg.history[-1]["test_acc_mean"]
    assert acc_lg >= 0.9 and acc_lg > fedavg.history[-1]["test_acc_mean"] + 0.1
    vectors = lg.runtime.client_vectors()
    assert len(vectors) == 4 and not np.allclose(vectors[0][:100], vectors[1][:100])  # own local layers


class Participants(Callback):
    def __init__(self):
        self.rounds = []

    def on_round(self, loop, record):
        self.rounds.append(sorted(record.participants))


def test_the_warm_start_is_fedavg_then_every_device_starts_from_its_last_model():
    p, fedavg = run("fedavg", rounds=2, participation=0.5)
    lg_p = prepare(tiny(algo="lg-fedavg", **{**KW, "rounds": 3, "participation": 0.5},
                        params={"fedavg_rounds": 2}))
    seen = Participants()
    lg = Loop(lg_p, LocalRuntime(lg_p), callbacks=[seen]).run()
    for a, b in zip(fedavg.history, lg.history[:2]):  # the same two FedAvg rounds
        assert a["train_loss"] == b["train_loss"]
        assert a["test_acc_mean"] == pytest.approx(b["test_acc_mean"])
    last = seen.rounds[2]
    vectors = lg.runtime.client_vectors()
    assert sorted(vectors) == [0, 1, 2, 3]  # every device has a model of its own after the hand-over
    for c in range(4):
        if c in last:
            assert not np.array_equal(vectors[c], fedavg.server.global_ref)
        else:  # not trained since: the last FedAvg model, exactly
            np.testing.assert_array_equal(vectors[c], fedavg.server.global_ref)


def test_sample_level_dp_covers_lg_fedavg_and_user_level_is_refused():
    from rayfl.config import UserError

    tiny(algo="lg-fedavg", dp_noise=1.0, dp_level="sample", params={"fedavg_rounds": 1}).check()
    with pytest.raises(UserError, match="dp_level=user cannot cover it"):
        tiny(algo="lg-fedavg", dp_noise=1.0, dp_level="user").check()
