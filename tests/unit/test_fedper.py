"""FedPer (Arivazhagan et al. 2019): which entries are the shared base, how a client takes the global base and
keeps its personalization layers, the size-weighted average of the base, which model is evaluated; and a run
through the real loop. The shared machinery (SplitClient, with_shared) also serves LG-FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny
from rayfl import training
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.layers import layer_slices
from rayfl.algorithms.common import shared_ranges, split_size, with_shared
from rayfl.algorithms.fedper import FedPerClient, FedPerParams, FedPerServer, base_mask
from rayfl.client import Bench, Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.models import build_model
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime


def two_layers():  # flat vector: W1 (4), b1 (2) | W2 (4), b2 (2): 12 entries, layers "0" and "2"
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def three_layers():  # W1 b1: 4+2 = 6 | W2 b2: 6+3 = 9 | W3 b3: 3+1 = 4, 19 entries
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))


def five_layers():
    return nn.Sequential(*[nn.Linear(1, 1) for _ in range(5)])  # 2 entries a layer


# ------------------------------------------------------------------------------------------- the split

def test_with_shared_takes_the_shared_entries_and_keeps_the_rest():
    own = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    received = np.array([10.0, 20.0, 30.0, 40.0, 50.0], np.float32)
    got = with_shared(own, received, [slice(0, 1), slice(2, 4)])
    assert got is own  # the working copy, written in place
    np.testing.assert_array_equal(own, [10.0, 2.0, 30.0, 40.0, 5.0])
    own_t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    with_shared(own_t, torch.from_numpy(received), [slice(3, 5)])
    np.testing.assert_array_equal(own_t.numpy(), [1.0, 2.0, 3.0, 40.0, 50.0])


def test_shared_ranges_are_the_masks_runs_of_true():
    assert shared_ranges(np.array([True, False, True, True, False])) == [slice(0, 1), slice(2, 4)]
    assert shared_ranges(np.array([False, True, True])) == [slice(1, 3)]
    assert shared_ranges(np.array([True] * 6 + [False] * 6)) == [slice(0, 6)]
    assert shared_ranges(np.zeros(4, bool)) == []


def test_the_base_is_every_layer_but_the_top_k_p():
    np.testing.assert_array_equal(base_mask(two_layers(), 1), [True] * 6 + [False] * 6)
    np.testing.assert_array_equal(base_mask(three_layers(), 1), [True] * 15 + [False] * 4)
    np.testing.assert_array_equal(base_mask(three_layers(), 2), [True] * 6 + [False] * 13)
    # 0: the default, K_P = 2 capped at L - 1
    np.testing.assert_array_equal(base_mask(two_layers(), 0), [True] * 6 + [False] * 6)  # L = 2: K_P = 1
    np.testing.assert_array_equal(base_mask(three_layers(), 0), [True] * 6 + [False] * 13)  # K_P = 2
    np.testing.assert_array_equal(base_mask(five_layers(), 0), [True] * 6 + [False] * 4)  # K_P = 2, not 3
    np.testing.assert_array_equal(base_mask(five_layers(), FedPerParams().personal_layers), [True] * 6 + [False] * 4)
    assert [split_size(0, n) for n in (2, 3, 4, 5)] == [1, 2, 2, 2]
    assert [split_size(k, 5) for k in (1, 3, 4)] == [1, 3, 4]


def test_params_check_rejects_bad_values():
    FedPerParams().check(3)
    FedPerParams(personal_layers=4).check(3)
    for bad in (-1, 1.5, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="personal_layers="):
            FedPerParams(personal_layers=bad).check(3)


def test_the_run_needs_a_layer_on_each_side_of_the_split():
    from rayfl.config import UserError

    prepare(tiny(algo="fedper", params={"personal_layers": 1}))  # mlp-small: 2 layers
    prepare(tiny(algo="fedper", dataset="digits", model="lenet5", params={"personal_layers": 4}))
    with pytest.raises(UserError, match="personal_layers=2: model 'mlp-small' has 2 layers, so at most 1"):
        prepare(tiny(algo="fedper", params={"personal_layers": 2}))
    with pytest.raises(UserError, match="personal_layers=5: model 'lenet5' has 5 layers"):
        prepare(tiny(algo="fedper", dataset="digits", model="lenet5", params={"personal_layers": 5}))
    with pytest.raises(UserError, match="model='sine-mlp': has 1 layer"):
        prepare(tiny(algo="fedper", dataset="sine", partition="iid"))  # auto: sine-mlp
    with pytest.raises(UserError, match="model='logreg': has 1 layer"):
        prepare(tiny(algo="fedper", model="logreg"))
    assert [len(layer_slices(build_model(m, (1, 28, 28), 10))) for m in ("mcmahan-cnn", "tf-cnn", "mlp-784-100")] \
        == [4, 5, 2]


# ------------------------------------------------------------------------------------------- a round

def clients(sizes, lr=0.5, bench=None):
    g = torch.Generator().manual_seed(1)
    bench = bench or Bench(two_layers, None)
    out = []
    for cid, n in enumerate(sizes):
        x = torch.randn(n + 8, 2, generator=g)
        y = (x[:, 0] > 0).long() if cid % 2 else (x[:, 0] <= 0).long()  # opposite labels: heads must differ
        splits = {"train": (x[:n], y[:n]), "val": (x[n:n + 4], y[n:n + 4]), "test": (x[n + 4:], y[n + 4:])}
        out.append(Client(cid, splits, None, None, TrainSettings("classification", 2, lr, 4), 0, bench=bench))
    return out


def server(n_train, initial):
    info = RunInfo(n_clients=len(n_train), rounds=2, participation=1.0, seed=0, n_train=n_train)
    return FedPerServer(FedPerParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                        initial=initial)


def fake_call(logic, cs):
    """What a host does: the named step on each client, then the size-weighted reduction of the uploads."""
    def call(step, messages, reduce=None):
        ups = {c: getattr(logic, f"step_{step}")(cs[c], m, m.get("models", {})) for c, m in messages.items()}
        return reduce_uploads(reduce, ups)
    return call


def test_a_round_averages_the_base_by_size_and_leaves_each_head_to_its_client():
    cs = clients([10, 20, 30])
    logic = FedPerClient(FedPerParams(personal_layers=1))
    base = np.arange(12) < 6
    srv = server([10, 20, 30], cs[0].vector())
    srv.run_round(Stage("train", 2), 0, [0, 1, 2], fake_call(logic, cs))
    trained = [c.weights() for c in cs]  # what each uploaded: its whole model after local training
    expect = (10 * trained[0].astype(np.float64) + 20 * trained[1] + 30 * trained[2]) / 60
    np.testing.assert_allclose(srv.global_ref[base], expect[base], rtol=1e-6, atol=1e-7)
    assert not np.allclose(trained[0][~base], trained[1][~base])  # the heads parted ways

    # round 2 without training (lr 0): what a client keeps through the aggregation is exactly its own head
    for c in cs:
        c.settings = TrainSettings("classification", 2, 0.0, 4)
    g1 = srv.global_ref.copy()
    srv.run_round(Stage("train", 2), 1, [0, 1], fake_call(logic, cs))
    for c in (0, 1):
        np.testing.assert_array_equal(cs[c].weights(), np.concatenate([g1[:6], trained[c][6:]]))
    np.testing.assert_array_equal(cs[2].weights(), trained[2])  # not taking part: its model as it was
    expect = (10 * np.concatenate([g1[:6], trained[0][6:]]).astype(np.float64)
              + 20 * np.concatenate([g1[:6], trained[1][6:]])) / 30
    np.testing.assert_allclose(srv.global_ref, expect, rtol=1e-6, atol=1e-7)


def test_the_mask_is_made_once_per_host_from_its_model():
    made = []

    class Counting(FedPerClient):
        def shared_mask(self, model):
            made.append(model)
            return super().shared_mask(model)

    bench = Bench(two_layers, None)
    cs = clients([6, 6, 6], bench=bench)
    logic = Counting(FedPerParams())
    srv = server([6, 6, 6], cs[0].vector())
    for rnd in range(2):
        srv.run_round(Stage("train", 2), rnd, [0, 1, 2], fake_call(logic, cs))
        for c, msg in srv.eval_messages(Stage("train", 2), rnd, [0, 1, 2]).items():
            logic.step_evaluate(cs[c], msg, msg["models"])
    assert len(made) == 1 and made[0] is bench.resident  # the client's own model, once
    assert all(c.state == {} for c in cs)


def test_taking_the_shared_part_writes_only_the_base_into_flat_and_plain_models():
    c = crafted_client()
    logic = FedPerClient(FedPerParams())  # mlp of 2 layers: K_P = 1, the base is the first 6 entries
    own = np.arange(12, dtype=np.float32)
    received = np.arange(100, 112, dtype=np.float32)
    received.flags.writeable = False  # as Ray's object store hands it over
    expect = np.concatenate([received[:6], own[6:]])
    for model in (training.flatten(two_layers()), two_layers()):  # the flat fast path, the general one
        training.load_vector(model, own)
        assert logic.take_shared(c, model, received) is model
        np.testing.assert_array_equal(training.to_vector(model), expect)


# ------------------------------------------------------------------------------------------- evaluation

def crafted_client():
    """x = (a, -a), y = [a > 0]. A base W1 = I under the head W2 = [[0, 1], [1, 0]] is always right; W2 = I is
    always wrong; a zero base gives logits 0 (class 0, half right)."""
    a = torch.tensor([1.0, -2.0, 3.0, -1.0, 2.0, -3.0])
    x, y = torch.stack([a, -a], 1), (a > 0).long()
    c = Client(0, {"train": (x, y), "val": (x, y), "test": (x, y)}, two_layers, None,
               TrainSettings("classification", 1, 0.1, 4), 0)
    return c


IDENTITY, SWAP, ZERO = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 6


def test_a_client_is_evaluated_on_the_global_base_under_its_own_head():
    c = crafted_client()
    own = np.array(ZERO + SWAP, np.float32)  # its head right, its base broken
    glob = np.array(IDENTITY + IDENTITY, np.float32)  # the global base right, the average head wrong
    c.set_weights(own)
    rng_state, gen_state = c.rng.bit_generator.state, c.gen.get_state()
    rec = FedPerClient(FedPerParams()).step_evaluate(c, {}, {"global": glob})
    assert rec["test_acc"] == 1.0 and rec["val_acc"] == 1.0
    # what the alternatives would score: the client's own model 0.5, the global model 0
    assert training.evaluate(training.load_vector(two_layers(), own), *c.splits["test"], "classification")[1] == 0.5
    assert training.evaluate(training.load_vector(two_layers(), glob), *c.splits["test"], "classification")[1] == 0
    np.testing.assert_array_equal(c.weights(), own)  # evaluation leaves the client as it was
    assert c.rng.bit_generator.state == rng_state and torch.equal(c.gen.get_state(), gen_state)
    assert c.state == {}


# ------------------------------------------------------------------------------------------- the real loop

def test_fedper_learns_personal_heads_through_the_loop():
    kw = dict(clients=4, rounds=5, partition="pathological", classes_per_client=2, participation=0.75)
    p = prepare(tiny(algo="fedper", **kw))
    loop = Loop(p, LocalRuntime(p)).run()
    fedavg = prepare(tiny(algo="fedavg", **kw))
    base_acc = Loop(fedavg, LocalRuntime(fedavg)).run().history[-1]["test_acc_mean"]
    acc = loop.history[-1]["test_acc_mean"]
    assert acc >= 0.9 and acc > base_acc + 0.1  # 2 classes per client: a personal head wins over FedAvg
    # each client's reported record is its own vector under the final global base
    glob = loop.server.global_ref
    shared = base_mask(p.model_spec.build(), 0)
    vectors = loop.runtime.client_vectors()
    heads = {c: v[~shared] for c, v in vectors.items()}
    assert not np.allclose(heads[0], heads[1])
    for host in loop.runtime.hosts:
        for cid, client in host.clients.items():
            model = training.load_vector(p.model_spec.build(), np.where(shared, glob, vectors[cid]))
            loss, acc_c = training.evaluate(model, *client.splits["test"], "classification")
            assert loop.last_eval[cid]["test_acc"] == acc_c
            assert loop.last_eval[cid]["test_loss"] == pytest.approx(loss, rel=1e-5)


def test_sample_level_dp_covers_fedper_and_user_level_is_refused():
    """Its training is client.fit's (sample-level DP applies); its uploads' personal entries are no update of the
    global model's, so its server does not offer them to user-level DP's clipped sum."""
    from rayfl.config import UserError

    tiny(algo="fedper", dp_noise=1.0, dp_level="sample").check()
    with pytest.raises(UserError, match="dp_level=user cannot cover it"):
        tiny(algo="fedper", dp_noise=1.0, dp_level="user").check()
