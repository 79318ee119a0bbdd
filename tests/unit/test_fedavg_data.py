"""FedAvg + Data (Zhao et al. 2018, §4): the size of the shared set G (β = |G| / |D|) and its refusals, G drawn
class-balanced from the held-out set and the same for every client, each client's α portion, the warm-up model
trained on G, training (never validation or test) enlarged by the share, and end to end: data_frac = 0 is FedAvg,
and on one-class clients the shared data lifts the global model's accuracy on held-out samples it never saw."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny
from rayfl import training
from rayfl.algorithms import get_algorithm
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.fedavg_data import (FedAvgDataClient, FedAvgDataParams, FedAvgDataServer, client_share,
                                          first_per_class, per_class, shared_set)
from rayfl.client import Client, TrainSettings
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime

LABELS = np.repeat(np.arange(10), 20)  # a held-out set of 10 classes x 20


# ------------------------------------------------------------------------------------------- the shared set

def test_samples_per_class_is_beta_times_the_clients_data_over_the_classes():
    # k = round(β |D| / C): 0.05 x 400 / 10 = 2; 0.05 x 390 / 10 = 1.95 -> 2; 0.05 x 140 / 10 = 0.7 -> 1;
    # 0.05 x 300 / 10 = 1.5 -> 2 (halves up); 0.5 x 400 / 10 = 20: all of the held-out set
    assert per_class(0.05, 400, LABELS) == 2
    assert per_class(0.05, 390, LABELS) == 2
    assert per_class(0.05, 140, LABELS) == 1
    assert per_class(0.05, 300, LABELS) == 2
    assert per_class(0.5, 400, LABELS) == 20
    assert per_class(0.05, 400, np.repeat(np.arange(5), 40)) == 4  # 5 classes: 0.05 x 400 / 5


def test_too_large_or_too_small_a_share_and_no_held_out_set_are_refused_naming_data_frac():
    # 0.6 x 400 / 10 = 24 per class > the 20 held: at most 20 x 10 / 400 = 0.5
    with pytest.raises(ValueError, match=r"data_frac=0.6: asks 24 .* has 20; allowed here: 0, or 0.0125 <= "
                                         r"data_frac <= 0.5$"):
        per_class(0.6, 400, LABELS)
    # 0.01 x 400 / 10 = 0.4 -> 0 per class: at least 10 / (2 x 400) = 0.0125
    with pytest.raises(ValueError, match=r"data_frac=0.01: asks 0 .* 0.0125 <= data_frac"):
        per_class(0.01, 400, LABELS)
    with pytest.raises(ValueError, match=r"data_frac=0.05: .*held-out set.*allowed: data_frac=0"):
        per_class(0.05, 400, LABELS[:0])


def test_first_per_class_on_hand_numbers():
    # labels by position 0..5: 0 1 0 1 0 1; along the order 5 4 3 2 1 0 the first two of class 1 are at 5 and 3,
    # of class 0 at 4 and 2
    labels = np.array([0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(first_per_class(labels, np.arange(6)[::-1], 2), [2, 3, 4, 5])
    np.testing.assert_array_equal(first_per_class(labels, np.array([1, 0, 2, 4, 3, 5]), 1), [0, 1])


def test_shared_set_is_class_balanced_seeded_and_the_same_whatever_the_labels_are_called():
    g = shared_set(LABELS, 3, seed=7)
    assert len(np.unique(g)) == 30 and np.bincount(LABELS[g]).tolist() == [3] * 10
    np.testing.assert_array_equal(shared_set(LABELS, 3, seed=7), g)  # the same for every client of a run
    assert not np.array_equal(shared_set(LABELS, 3, seed=8), g)  # and another draw for another seed
    renamed = (LABELS * 3 + 1) % 10  # a label permutation (the permutation partition's groups)
    np.testing.assert_array_equal(shared_set(renamed, 3, seed=7), g)
    assert set(shared_set(LABELS, 5, seed=7)) >= set(g)  # a larger k extends the same draw


def test_each_client_gets_a_random_alpha_portion_of_each_class():
    g = shared_set(LABELS, 10, seed=1)
    np.testing.assert_array_equal(client_share(LABELS, g, 10, 1.0, 1, cid=4), g)  # α = 1: all of G
    for alpha, per in ((0.5, 5), (0.34, 4), (0.3, 3), (0.01, 1)):  # ⌈α k⌉ of each class, k = 10
        mine = client_share(LABELS, g, 10, alpha, 1, cid=4)
        assert set(mine) <= set(g) and np.bincount(LABELS[mine]).tolist() == [per] * 10, alpha
    a, b = client_share(LABELS, g, 10, 0.5, 1, cid=0), client_share(LABELS, g, 10, 0.5, 1, cid=1)
    assert not np.array_equal(a, b)  # drawn for each client
    np.testing.assert_array_equal(client_share(LABELS, g, 10, 0.5, 1, cid=0), a)  # seeded
    assert not np.array_equal(client_share(LABELS, g, 10, 0.5, 2, cid=0), a)  # by the run's seed too


# ------------------------------------------------------------------------------------------- client side

def make_client(cid=0):
    """Linear(2, 3) on 6 training samples; a held-out set of 3 classes x 4 (the host's "global" split)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=gen)
    hy = torch.arange(3).repeat(4)
    splits = {"train": (x[:6], torch.tensor([0, 1, 2, 0, 1, 2])), "val": (x[6:9], torch.tensor([0, 1, 2])),
              "test": (x[9:12], torch.tensor([2, 1, 0])), "global": (x[12:24], hy)}
    settings = TrainSettings("classification", 2, 0.1, 4)
    return Client(cid, splits, lambda: torch.nn.Linear(2, 3), np.zeros(9, np.float32), settings, 0)


def test_training_appends_the_clients_share_of_g_and_leaves_val_and_test_alone():
    client, w = make_client(cid=2), np.full(9, 0.1, np.float32)
    logic = FedAvgDataClient(FedAvgDataParams(data_frac=0.5, share_frac=0.5))
    before = dict(client.splits)
    gen = torch.Generator()
    gen.set_state(client.gen.get_state())
    up = logic.step_train(client, {"n_total": 12, "seed": 3}, {"global": w})
    # k = round(0.5 x 12 / 3) = 2 per class, the client's share ⌈0.5 x 2⌉ = 1 per class: 6 + 3 samples
    assert up["n"] == 9
    hy = before["global"][1].numpy()
    mine = client_share(hy, shared_set(hy, 2, 3), 2, 0.5, 3, cid=2)
    assert np.bincount(hy[mine]).tolist() == [1, 1, 1]
    # the same training by hand: 2 epochs of SGD (lr 0.1, batches of 4) on the training split, then the share
    x = torch.cat([before["train"][0], before["global"][0][mine]])
    y = torch.cat([before["train"][1], before["global"][1][mine]])
    model = training.load_vector(torch.nn.Linear(2, 3), w)
    loss = training.train_epochs(model, x, y, 2, 4, torch.optim.SGD(model.parameters(), lr=0.1),
                                 torch.nn.functional.cross_entropy, gen)
    np.testing.assert_allclose(up["weights"], training.to_vector(model), rtol=1e-6)
    assert up["train_loss"] == pytest.approx(loss)
    assert client.splits.keys() == before.keys()  # the enlarged set was for that call only
    assert all(client.splits[s] is before[s] for s in before)
    assert logic.eval_weights({}, {"global": w}) is w  # evaluated like FedAvg: the global model
    assert FedAvgDataClient.uses_holdout  # the host hands it the held-out set


def test_data_frac_zero_trains_on_the_clients_own_data_only():
    client = make_client()
    up = FedAvgDataClient(FedAvgDataParams(data_frac=0.0)).step_train(client, {}, {"global": np.zeros(9, np.float32)})
    assert up["n"] == 6


def test_warm_up_trains_the_initial_model_on_all_of_g():
    client, w0 = make_client(), np.full(9, 0.1, np.float32)
    logic = FedAvgDataClient(FedAvgDataParams(data_frac=0.5, share_frac=0.5, warmup_epochs=3))
    gen = torch.Generator()
    gen.set_state(client.gen.get_state())
    up = logic.step_warmup(client, {"models": {}, "n_total": 12, "seed": 3}, {"global": w0})
    assert up["shared_per_class"] == 2 and up["shared_size"] == 6  # all of G, not the client's α share
    # the same training by hand: 3 epochs of SGD (lr 0.1, batches of 4) on G's six samples from w0
    gx, gy = client.splits["global"]
    g = shared_set(gy.numpy(), 2, 3)
    model = training.load_vector(torch.nn.Linear(2, 3), w0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = training.train_epochs(model, gx[g], gy[g], 3, 4, opt, torch.nn.functional.cross_entropy, gen)
    np.testing.assert_allclose(up["weights"], training.to_vector(model), rtol=1e-6)
    assert up["warmup_loss"] == pytest.approx(loss)
    none = FedAvgDataClient(FedAvgDataParams(data_frac=0.5, warmup_epochs=0)).step_warmup(
        make_client(), {"n_total": 12, "seed": 3}, {"global": w0})
    assert "weights" not in none and none["shared_size"] == 6


def test_a_client_without_a_held_out_set_refuses():
    client = make_client()
    del client.splits["global"]
    with pytest.raises(ValueError, match="data_frac=0.05: .*allowed: data_frac=0"):
        FedAvgDataClient(FedAvgDataParams()).step_train(client, {"n_total": 12, "seed": 0}, {"global": np.zeros(9)})


# ------------------------------------------------------------------------------------------- server side

def make_server(**params):
    info = RunInfo(n_clients=3, rounds=2, participation=1.0, seed=5, n_train=[10, 20, 30])
    return FedAvgDataServer(FedAvgDataParams(**params), info, put=lambda v: v, get=list,
                            rng=np.random.default_rng(0), initial=np.zeros(2, np.float32))


def test_setup_warms_up_on_client_0_and_rounds_tell_clients_how_to_draw_g():
    srv, calls = make_server(), []

    def call(step, msgs, reduce=None):
        calls.append((step, msgs))
        if step == "warmup":
            return {0: {"weights": np.array([3.0, 4.0], np.float32), "shared_per_class": 1.0, "shared_size": 10.0,
                        "warmup_loss": 0.5}}
        return reduce_uploads(reduce, {c: {"weights": np.full(2, float(c), np.float32), "n": 1 + c,
                                           "train_loss": 1.0} for c in msgs})

    metrics = srv.setup(call)
    (step, msgs), = calls
    assert step == "warmup" and list(msgs) == [0]  # one client, before the first round
    assert msgs[0]["n_total"] == 60 and msgs[0]["seed"] == 5  # |D| = 10 + 20 + 30, the run's seed
    np.testing.assert_array_equal(msgs[0]["models"]["global"], np.zeros(2))  # from the common initial model
    np.testing.assert_array_equal(srv.global_ref, [3.0, 4.0])  # the warm-up model is the first global model
    assert metrics == {"shared_per_class": 1.0, "shared_size": 10.0, "warmup_loss": 0.5}
    srv.run_round(Stage("train", 2), 0, [1, 2], call)
    step, msgs = calls[-1]
    assert step == "train" and msgs[1] == msgs[2] == {"models": {"global": msgs[1]["models"]["global"]},
                                                      "n_total": 60, "seed": 5}
    np.testing.assert_array_equal(msgs[1]["models"]["global"], [3.0, 4.0])
    np.testing.assert_allclose(srv.global_ref, [(2 * 1 + 3 * 2) / 5] * 2)  # FedAvg: weighted by n


def test_data_frac_zero_is_fedavg_on_the_server_too():
    srv = make_server(data_frac=0.0)
    assert srv.setup(lambda *a, **k: pytest.fail("no warm-up call")) == {}
    msgs = {}
    srv.run_round(Stage("train", 2), 0, [0], lambda step, m, reduce=None: msgs.update(m) or reduce_uploads(
        reduce, {0: {"weights": np.ones(2, np.float32), "n": 1, "train_loss": 0.0}}))
    assert msgs[0] == {"models": {"global": msgs[0]["models"]["global"]}}


# ------------------------------------------------------------------------------------------- knobs

def test_params_check_and_defaults():
    p = FedAvgDataParams()
    assert (p.data_frac, p.share_frac, p.warmup_epochs) == (0.05, 1.0, 1)  # β = 5%, all of G to every client
    FedAvgDataParams(data_frac=0.0, share_frac=1.0, warmup_epochs=0).check(3)
    FedAvgDataParams(data_frac=1.0, share_frac=0.01).check(3)
    for bad in (dict(data_frac=-0.1), dict(data_frac=1.5), dict(data_frac=math.nan), dict(share_frac=0.0),
                dict(share_frac=1.5), dict(share_frac=math.nan), dict(warmup_epochs=-1)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            FedAvgDataParams(**bad).check(3)


def test_a_regression_dataset_is_refused_from_the_config():
    with pytest.raises(UserError, match="data_frac=0.05: .*allowed: data_frac=0"):
        tiny(algo="fedavg-data", dataset="sine").check()
    tiny(algo="fedavg-data", dataset="sine", params={"data_frac": 0.0}).check()  # FedAvg: fine
    FedAvgDataParams().check_config(tiny(dataset="synthetic"))


# ------------------------------------------------------------------------------------------- end to end

def run(algo="fedavg-data", **kw):
    p = prepare(tiny(algo=algo, **kw))
    return p, Loop(p, LocalRuntime(p)).run()


def test_data_frac_zero_is_exactly_fedavg():
    _, fedavg = run("fedavg", participation=0.67, rounds=3)
    _, zero = run(participation=0.67, rounds=3, params={"data_frac": 0.0})
    np.testing.assert_array_equal(zero.server.global_ref, fedavg.server.global_ref)
    assert zero.setup_metrics == {}


def test_too_much_shared_data_for_the_held_out_set_is_refused_before_any_client_starts():
    # 20 clients x 36 training samples, 20 held-out samples per class: 0.5 x 720 / 10 = 36 per class is too many
    from rayfl.config import UserError
    from rayfl.experiment import prepare

    with pytest.raises(UserError, match=r"data_frac=0.5: asks 36 shared samples per class .* has 20; allowed here: "
                                        r"0, or 0.006944 <= data_frac <= 0.2778$"):
        prepare(tiny(algo="fedavg-data", clients=20, rounds=1, params={"data_frac": 0.5}))
    prepare(tiny(algo="fedavg-data", clients=20, rounds=1, params={"data_frac": 0.25}))  # 18 per class: fits



def test_shared_data_lifts_one_class_clients_global_model_on_held_out_samples_it_never_saw():
    def held_out_acc(p, loop):
        y = p.dataset.y[p.federation.holdout]
        g = shared_set(y, int(loop.setup_metrics.get("shared_per_class", 0)) or 1, p.cfg.seed)
        idx = np.delete(p.federation.holdout, g)  # the held-out samples outside G
        model = training.load_vector(p.model_spec.build(), loop.server.global_ref)
        return training.evaluate(model, torch.from_numpy(p.dataset.x[idx]), torch.from_numpy(p.dataset.y[idx]),
                                 "classification")[1]

    kw = dict(clients=10, rounds=4, partition="pathological", classes_per_client=1)
    pa, fedavg = run("fedavg", **kw)
    pd, data = run(params={"data_frac": 0.2}, **kw)
    assert data.setup_metrics["shared_per_class"] == 7  # 0.2 x (10 x 36) / 10 = 7.2
    assert held_out_acc(pd, data) > held_out_acc(pa, fedavg) + 0.15  # 0.93 vs 0.60 with seed 0
    assert data.final["test_acc_mean"] > 0.7
    assert "global_acc" not in data.last_eval[0]  # the held-out set is not reported on: G came from it
    assert get_algorithm("fedavg-data").Server is FedAvgDataServer
