"""FedFomo (Zhang et al., 2021, §3.1): the weight math on hand-made numbers, the P update, ε-greedy selection, and a behaviour
test: on a small federation with latent groups, P ends up favouring same-group clients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.fedfomo import (FedFomoClient, FedFomoParams, FedFomoServer, epsilon_at, fomo_update,
                                      fomo_weights, fomo_weights_average, leave_one_out, model_distance,
                                      normalize_weights, select_models)
from rayfl.client import Client, TrainSettings
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime


# ------------------------------------------------------------------------------------------- the math

def test_weights_eq3_on_hand_numbers():
    # w_n = (L(base) - L(θ_n)) / ||θ_n - base||: better -> positive, worse -> negative, equal -> 0
    w = fomo_weights(2.0, np.array([1.0, 2.5, 2.0, 1.0]), np.array([2.0, 1.0, 4.0, 0.0]))
    np.testing.assert_allclose(w, [0.5, -0.5, 0.0, 0.0])  # the last is at distance 0: 0, not 0/0


def test_weights_eq14_model_average_on_hand_numbers_with_the_sign_change():
    # Appendix A.4, Eq. 14: w_n = (L(avg without θ_n) - L(avg)) / ||θ_n - avg||: a model whose removal raises the
    # loss helps (positive), one whose removal lowers it hurts (negative)
    w = fomo_weights_average(2.0, np.array([3.0, 1.0, 2.0, 3.0]), np.array([2.0, 1.0, 4.0, 0.0]))
    np.testing.assert_allclose(w, [0.5, -1.0, 0.0, 0.0])  # the last is at distance 0: 0, not 0/0
    # Eq. 3 on the same numbers (its losses those of the models themselves) has the opposite sign
    np.testing.assert_allclose(fomo_weights(2.0, np.array([3.0, 1.0, 2.0, 3.0]), np.array([2.0, 1.0, 4.0, 0.0])),
                               [-0.5, 1.0, 0.0, 0.0])


def test_leave_one_out_averages_by_hand():
    vecs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32), np.array([5.0, 9.0], np.float32)]
    avg, loo = leave_one_out(vecs)
    np.testing.assert_allclose(avg, [3.0, 5.0])
    np.testing.assert_allclose(loo, [[4.0, 6.5], [3.0, 5.5], [2.0, 3.0]])
    avg, loo = leave_one_out(vecs[:1])  # one model: no average without it
    np.testing.assert_allclose(avg, vecs[0])
    assert loo == []


def test_distance_l2_and_l1():
    a, b = np.array([3.0, 4.0], np.float32), np.zeros(2, np.float32)
    assert model_distance(a, b, "l2") == pytest.approx(5.0)
    assert model_distance(a, b, "l1") == pytest.approx(7.0)


def test_clipping_and_normalization_eq13():
    np.testing.assert_allclose(normalize_weights([0.5, -0.5, 1.5]), [0.25, 0.0, 0.75])
    np.testing.assert_allclose(normalize_weights([-1.0, 0.0, -3.0]), [0.0, 0.0, 0.0])  # Σ w* = 0: keep base


def test_update_and_no_positive_case():
    base = np.array([1.0, 1.0], np.float32)
    cands = [np.array([3.0, 1.0], np.float32), np.array([1.0, 5.0], np.float32), np.array([9.0, 9.0], np.float32)]
    new = fomo_update(base, cands, np.array([0.25, 0.75, 0.0]))
    np.testing.assert_allclose(new, [1.0 + 0.25 * 2.0, 1.0 + 0.75 * 4.0])  # base + Σ w*_n (θ_n - base)
    kept = fomo_update(base, cands, np.zeros(3))
    np.testing.assert_array_equal(kept, base)
    assert kept is not base


def test_epsilon_additive_decay():
    assert [round(epsilon_at(0.3, 0.05, r), 10) for r in (0, 1, 5, 6, 50)] == [0.3, 0.25, 0.05, 0.0, 0.0]


# ------------------------------------------------------------------------------------------- selection

def test_greedy_picks_top_of_p_and_never_self():
    p = np.array([9.0, 1.0, 5.0, 3.0, 4.0, 0.0])
    rng = np.random.default_rng(0)
    assert select_models(p, 0, list(range(6)), 3, 0.0, rng) == [2, 4, 3]
    assert select_models(p, 0, [0, 1, 3], 3, 0.0, rng) == [3, 1]  # fewer available than slots
    assert select_models(p, 0, [0], 3, 0.0, rng) == []


def test_epsilon_greedy_counts_under_fixed_seed():
    k, draws, eps = 10, 4000, 0.3
    p = np.zeros(k)
    p[[1, 2]] = [5.0, 4.0]

    def counts(seed):
        rng = np.random.default_rng(seed)
        c = np.zeros(k, dtype=int)
        for _ in range(draws):
            for j in select_models(p, 0, list(range(k)), 1, eps, rng):
                c[j] += 1
        return c

    c = counts(123)
    np.testing.assert_array_equal(c, counts(123))  # seeded: the same draws every time
    assert c[0] == 0 and c.sum() == draws
    # one slot: the top model with prob (1-ε) + ε/9, each other with ε/9
    expect_top, expect_other = (1 - eps) + eps / 9, eps / 9
    assert abs(c[1] / draws - expect_top) < 4 * np.sqrt(expect_top * (1 - expect_top) / draws)
    for j in range(2, k):
        assert abs(c[j] / draws - expect_other) < 4 * np.sqrt(expect_other * (1 - expect_other) / draws)


def test_ties_at_start_are_broken_at_random():
    p = np.eye(6)[0]  # P = identity: every other client tied at 0
    rng = np.random.default_rng(1)
    firsts = {select_models(p, 0, list(range(6)), 1, 0.0, rng)[0] for _ in range(200)}
    assert firsts == {1, 2, 3, 4, 5}


# ------------------------------------------------------------------------------------------- driver side

def make_server(k=4, **params):
    info = RunInfo(n_clients=k, rounds=3, participation=1.0, seed=0, n_train=[10] * k)
    return FedFomoServer(FedFomoParams(**params), info, put=lambda v: v, get=list,
                         rng=np.random.default_rng(0), initial=np.zeros(3, np.float32))


def test_p_update_uses_raw_w_and_stores_uploads():
    srv = make_server(M=3, epsilon=0.0)
    np.testing.assert_array_equal(srv.P, np.eye(4))  # identity at start
    srv.uploads = {c: np.full(3, c, np.float32) for c in range(4)}
    srv.P[0, 3] = 2.0
    sent = {}

    def call(step, messages):
        sent.update(messages)
        return {c: {"w": {c: 0.2, **{j: (-0.5 if j == 3 else 0.3) for j in m["models"]["peers"]}},
                    "w_star": {c: 0.4, **{j: (0.0 if j == 3 else 0.6) for j in m["models"]["peers"]}},
                    "kept_base": False, "weights": np.full(3, 10 + c, np.float32), "train_loss": 1.0, "n": 10}
                for c, m in messages.items()}

    metrics = srv.run_round(Stage("train", 3), 1, [0, 1], call)
    assert set(sent) == {0, 1} and len(sent[0]["models"]["peers"]) == 2  # M - 1 others; own is local
    assert 3 in sent[0]["models"]["peers"]  # the top of row 0
    peers0 = sorted(sent[0]["models"]["peers"])
    expected = np.eye(4)[0] + np.array([0, 0, 0, 2.0])
    expected[0] += 0.2
    for j in peers0:
        expected[j] += -0.5 if j == 3 else 0.3  # raw w, negative too
    np.testing.assert_allclose(srv.P[0], expected)
    assert srv.W[0, 0] == 0.4 and srv.W[0, 3] == 0.0
    srv.W[1] = 7.0  # the last round's row is replaced, not added to: models not downloaded now get NaN
    srv.run_round(Stage("train", 3), 2, [1], call)
    candidates = sorted([1] + list(sent[1]["models"]["peers"]))
    assert srv.W[1, 1] == 0.4 and sorted(np.flatnonzero(~np.isnan(srv.W[1])).tolist()) == candidates
    assert sorted(np.flatnonzero(np.nan_to_num(srv.W[1])).tolist()) == sorted(
        [1] + [j for j in sent[1]["models"]["peers"] if j != 3])  # model 3 lost: downloaded, weight 0
    np.testing.assert_array_equal(srv.uploads[0], np.full(3, 10.0))  # replaced, never averaged
    np.testing.assert_array_equal(srv.uploads[2], np.full(3, 2.0))  # non-participant: kept
    assert metrics["fedfomo_explore_rate"] == 0.0 and "epsilon" not in metrics and metrics["train_loss"] == 1.0
    assert set(srv.artifacts()) >= {"P", "weights"} and srv.artifacts()["weights"].shape == (4, 4)
    assert set(srv.round_artifacts(1)) == {"P"}


def test_params_check():
    FedFomoParams(M=5).check(5)
    FedFomoParams(M=1, epsilon=0.0, lr_decay=1.0).check(5)  # boundaries allowed: no exploration, no decay
    FedFomoParams(epsilon=1.0, epsilon_decay=0.0).check(5)
    for bad in (dict(M=6), dict(M=0), dict(epsilon=1.5), dict(epsilon_decay=-0.1), dict(distance="cos")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FedFomoParams(**bad).check(5)


# ------------------------------------------------------------------------------------------- client side

def tiny_client(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 3, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:20], y[:20]), "val": (x[20:30], y[20:30]), "test": (x[30:], y[30:])}
    make = lambda: torch.nn.Linear(3, 2)  # noqa: E731
    settings = TrainSettings("classification", 1, 0.1, 8)
    return Client(0, splits, make, np.zeros(8, np.float32), settings, seed)


def test_client_step_weighs_against_base_and_keeps_base_when_nothing_helps():
    client, logic = tiny_client(), FedFomoClient(FedFomoParams(M=3))
    # Linear(3, 2) flattened: weight rows (class 0, class 1), then bias; logit_1 - logit_0 = 4·x0 is right
    good = np.array([-2, 0, 0, 2, 0, 0, 0, 0], np.float32)
    bad = -good
    base = np.zeros(8, np.float32)
    client.state["base"] = base
    client.load(bad)  # own latest model: worse than base
    up = logic.step_fomo(client, {"train": False}, {"peers": {1: good, 2: bad}})
    lb = client.loss(client.new_model(base))
    lg, lbad = client.loss(client.new_model(good)), client.loss(client.new_model(bad))
    d = np.linalg.norm(good)
    assert up["w"][1] == pytest.approx((lb - lg) / d) and up["w"][1] > 0
    assert up["w"][2] == pytest.approx((lb - lbad) / d) and up["w"][0] == pytest.approx((lb - lbad) / d)
    assert up["w_star"] == {1: 1.0, 2: 0.0, 0: 0.0} and not up["kept_base"]
    np.testing.assert_allclose(client.vector(), good, atol=1e-6)  # base + 1.0·(good - base)
    client.load(bad)
    up = logic.step_fomo(client, {"train": False}, {"peers": {2: bad}})
    assert up["kept_base"] and not any(up["w_star"].values())
    np.testing.assert_array_equal(client.vector(), base)


def test_model_average_variant_weighs_each_model_by_what_leaving_it_out_costs():
    """baseline="average": candidates good, zero (peers) and bad (own), bad = -good, so their average is 0. Leaving
    good out gives bad/2 (loss up: w > 0), leaving bad out gives good/2 (loss down: w < 0), zero sits at the
    average (distance 0: w = 0); the client moves to 0 + 1.0·(good - 0)."""
    client, logic = tiny_client(), FedFomoClient(FedFomoParams(M=3, baseline="average"))
    good = np.array([-2, 0, 0, 2, 0, 0, 0, 0], np.float32)
    bad, zero = -good, np.zeros(8, np.float32)
    client.state["base"] = np.full(8, 5.0, np.float32)  # the single variant's baseline: not read here
    client.load(bad)
    up = logic.step_fomo(client, {"train": False}, {"peers": {1: good, 2: zero}})
    loss = lambda v: client.loss(client.new_model(v))  # noqa: E731
    d = np.linalg.norm(good)
    assert up["w"][1] == pytest.approx((loss(bad / 2) - loss(zero)) / d) and up["w"][1] > 0
    assert up["w"][0] == pytest.approx((loss(good / 2) - loss(zero)) / d) and up["w"][0] < 0
    assert up["w"][2] == 0.0
    assert up["w_star"] == {1: 1.0, 2: 0.0, 0: 0.0} and not up["kept_base"]
    np.testing.assert_allclose(client.vector(), good, atol=1e-6)
    up = logic.step_fomo(client, {"train": False}, {"peers": {2: zero}})  # own (now good) and zero: avg good/2
    assert up["w"][0] > 0 and up["w"][2] < 0
    with pytest.raises(ValueError, match="baseline='median'"):
        FedFomoParams(baseline="median").check(5)


def test_client_trains_after_update_and_records_its_base():
    client, logic = tiny_client(), FedFomoClient(FedFomoParams())
    up = logic.step_fomo(client, {"train": True, "round": 0}, {})  # round 0: no downloads, train only
    np.testing.assert_array_equal(client.state["base"], np.zeros(8, np.float32))
    assert "weights" in up and up["n"] == 20 and up["w"] == {}
    assert not np.array_equal(up["weights"], client.state["base"])


# ------------------------------------------------------------------------------------------- behaviour

def test_p_favours_same_group_clients_on_latent_groups():
    cfg = make_config(None, {"algo": "fedfomo", "dataset": "synthetic", "partition": "label-groups", "groups": 2,
                             "group_assign": "blocks", "clients": 6, "rounds": 5, "lr": 0.1, "params": {"M": 3}})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p)).run()
    groups = np.array(p.info.groups)
    P = loop.server.artifacts()["P"]
    same = groups[:, None] == groups[None, :]
    off = ~np.eye(len(groups), dtype=bool)
    assert P[same & off].mean() > P[~same].mean() + 0.5
    for i in range(len(groups)):  # each client's row too
        assert P[i, same[i] & off[i]].mean() > P[i, ~same[i]].mean()
    assert loop.history[-1]["stage"] == "update" and loop.final["test_acc_mean"] > 0.8


# ------------------------------------------------------------------------------------------- departures

def test_final_update_round_does_not_train():
    """The extra update after the last training round only weighs downloads: no training, no new upload."""
    srv = make_server(M=2, epsilon=0.0)
    srv.uploads = {c: np.full(3, c, np.float32) for c in range(4)}
    sent = {}

    def call(step, messages):
        sent.update(messages)
        return {c: {"w": {}, "w_star": {}, "kept_base": True,
                    **({"weights": np.full(3, 10 + c, np.float32), "train_loss": 1.0, "n": 10} if m["train"] else {})}
                for c, m in messages.items()}

    assert [s.name for s in srv.stages()] == ["train", "update"]
    metrics = srv.run_round(srv.stages()[1], 3, [0, 1, 2, 3], call)
    assert sent and all(m["train"] is False for m in sent.values())
    assert "train_loss" not in metrics
    for c in range(4):
        np.testing.assert_array_equal(srv.uploads[c], np.full(3, c, np.float32))
    srv.run_round(srv.stages()[0], 2, [0], call)
    assert sent[0]["train"] is True
    assert [s.name for s in make_server(final_update=False).stages()] == ["train"]


def test_learning_rate_decays_per_round():
    """Paper A.6: lr·0.99^r; checked with a decay of 0.5 at round 3 against the lr local training receives."""
    client, logic = tiny_client(), FedFomoClient(FedFomoParams(lr_decay=0.5))
    seen = []
    fit = client.fit
    client.fit = lambda **kw: seen.append(kw.get("lr")) or fit(**kw)
    logic.step_fomo(client, {"train": True, "round": 3}, {})
    assert seen == [pytest.approx(0.1 * 0.5 ** 3)]


def test_paper_defaults():
    """Zhang et al., 2021, App. A.6: 5 models, ε = 0.3 decaying by 0.05 a round, lr decay 0.99, the code's final update."""
    p = FedFomoParams()
    assert (p.M, p.epsilon, p.epsilon_decay, p.distance, p.lr_decay, p.final_update) == (5, 0.3, 0.05, "l2", 0.99,
                                                                                       True)


def test_one_slot_or_one_other_client_still_downloads_and_a_validation_split_is_required():
    from types import SimpleNamespace

    from rayfl.algorithms.fedfomo import select_models

    p = np.array([1.0, 0.2, 0.9, 0.1])
    rng = np.random.default_rng(0)
    assert select_models(p, 0, [0, 1, 2, 3], 1, 0.0, rng) == [2]  # M = 2: one slot, the top other of p_0
    assert select_models(p, 0, [0, 3], 4, 0.0, rng) == [3]  # one other upload available: that one
    assert select_models(p, 0, [0, 1, 2, 3], 0, 0.0, rng) == []  # M = 1: own model only
    assert select_models(p, 0, [0], 3, 0.0, rng) == []  # nobody else has uploaded yet
    FedFomoParams().check_config(SimpleNamespace(val_frac=0.1))
    with pytest.raises(ValueError, match="val_frac=0.0"):
        FedFomoParams().check_config(SimpleNamespace(val_frac=0.0))


def test_kept_base_fraction_is_over_the_round_participants():
    srv = make_server(M=2, epsilon=0.0)
    srv.uploads = {c: np.full(3, c, np.float32) for c in range(4)}

    def call(step, messages):  # client 0 found no better model (kept its base), clients 1 and 2 did
        return {c: {"w": {}, "w_star": {}, "kept_base": c == 0, "weights": np.zeros(3, np.float32),
                    "train_loss": 1.0, "n": 10} for c in messages}

    metrics = srv.run_round(Stage("train", 3), 0, [0, 1, 2], call)
    assert metrics["kept_base_frac"] == pytest.approx(1 / 3)
    assert metrics["downloads_mean"] == 1.0  # M - 1 downloads each


def test_lr_decay_zero_is_refused_and_every_client_takes_the_final_update():
    with pytest.raises(ValueError, match="lr_decay=0.0"):
        FedFomoParams(lr_decay=0.0).check(5)  # lr x 0^r: no training after the first round
    srv = make_server(k=4)  # participation 1 here, but the last update is for every client whatever it is
    train, update = srv.stages()
    assert (train.name, train.sample, update.name, update.rounds, update.sample) == ("train", True, "update", 1,
                                                                                      False)
