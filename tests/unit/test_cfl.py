"""CFL (Sattler, Müller, Samek, IEEE TNNLS 2021): the cosine similarities, the norms and the split criterion on
hand-made numbers, the optimal bipartition (Algorithm 1, against brute force and against the authors' code's
complete linkage), the γ_max check, the server's rounds on hand-made uploads (split, recursion, clients that
missed a split moving down the parameter tree, state), and two behaviours through the real loop: CFL is FedAvg
to the bit until a split, and on two label-permuted groups the split separates the groups."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from conftest import same, tiny
from rayfl import snapshot
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.cfl import (CFLClient, CFLParams, CFLServer, accept_split, bipartition, branch_direction,
                                  cluster_average, cosine_similarities, cross_similarity, gamma_bound, route,
                                  mean_update_norm, split_criterion, update_norm)
from rayfl.client import Client, TrainSettings
from rayfl.experiment import prepare
from rayfl.metrics import cluster_purity
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime

S2 = 1 / math.sqrt(2)


# ------------------------------------------------------------------------------------------- the math

def test_cosine_similarity_on_hand_made_updates():
    d = np.array([[1, 0], [0, 2], [3, 3], [-1, 0], [0, 0]], np.float32)
    # <d0,d2> = 3, ||d0|| ||d2|| = 1·√18: 1/√2; <d1,d2> = 6 / (2·√18) = 1/√2; d0, d3 opposite;
    # the zero update: 0
    expected = np.array([[1, 0, S2, -1, 0], [0, 1, S2, 0, 0], [S2, S2, 1, -S2, 0], [-1, 0, -S2, 1, 0],
                         [0, 0, 0, 0, 0]])
    np.testing.assert_allclose(cosine_similarities(d), expected, atol=1e-12)
    np.testing.assert_allclose(cosine_similarities(d * 7.0), expected, atol=1e-12)  # invariant to scale
    assert cosine_similarities(np.array([[1e-3, 2e-3]] * 2)).max() <= 1.0  # clipped: never just above 1


def test_norms_are_the_weighted_mean_update_and_each_update():
    start = np.array([1.0, 1.0], np.float32)
    trained = [start + np.array([3.0, 0.0], np.float32), start + np.array([0.0, 4.0], np.float32)]
    assert [update_norm(t, start) for t in trained] == [3.0, 4.0]
    # Σ n_i Δθ_i / Σ n_i with n = (1, 3) = (0.75, 3): norm √9.5625; the plain mean (1.5, 2) would give 2.5, the
    # mean of the norms 3.5
    assert mean_update_norm(cluster_average(trained, [1, 3]), start) == pytest.approx(math.sqrt(9.5625))
    opposite = [start + np.array([1.0, 0.0], np.float32), start - np.array([1.0, 0.0], np.float32)]
    assert mean_update_norm(cluster_average(opposite, [5, 5]), start) == 0.0  # they cancel out
    assert update_norm(np.array([3.0, 4.0], np.float32), np.zeros(2, np.float32)) == 5.0


def test_split_criterion_each_inequality_on_both_sides():
    eps1, eps2 = 0.4, 1.6
    assert split_criterion(0.3, 2.0, eps1, eps2)
    assert split_criterion(0.399, 1.601, eps1, eps2)
    assert not split_criterion(0.4, 2.0, eps1, eps2)  # ||Δθ_c|| < ε1 is strict
    assert not split_criterion(0.5, 2.0, eps1, eps2)  # the cluster has not converged yet
    assert not split_criterion(0.3, 1.6, eps1, eps2)  # max ||Δθ_i|| > ε2 is strict
    assert not split_criterion(0.3, 1.0, eps1, eps2)  # every client is near stationary too: congruent


def two_blocks(seed=0, order=(0, 3, 4, 1, 2, 5)):
    """Six updates, two directions with noise: clients 0, 3, 4 around u, clients 1, 2, 5 around v ⟂ u."""
    rng = np.random.default_rng(seed)
    u, v = np.eye(8)[0] * 2.0, np.eye(8)[1] * 3.0
    rows = [u + 0.3 * rng.normal(size=8) for _ in range(3)] + [v + 0.3 * rng.normal(size=8) for _ in range(3)]
    out = np.zeros((6, 8))
    for k, i in enumerate(order):
        out[i] = rows[k]
    return out


@pytest.mark.parametrize("linkage", ["single", "complete"])
def test_bipartition_of_two_obvious_blocks_and_the_separation_property(linkage):
    alpha = cosine_similarities(two_blocks())
    c1, c2 = bipartition(alpha, linkage)
    assert (c1, c2) == ([0, 3, 4], [1, 2, 5])
    intra = min(alpha[np.ix_(c, c)][~np.eye(3, dtype=bool)].min() for c in (c1, c2))
    assert cross_similarity(alpha, c1, c2) == alpha[np.ix_(c1, c2)].max() < intra  # max cross < min intra


def test_single_linkage_attains_the_argmin_of_the_largest_cross_similarity():
    for seed in range(5):
        alpha = cosine_similarities(np.random.default_rng(seed).normal(size=(7, 5)))
        best = min(alpha[np.ix_(c, [j for j in range(7) if j not in c])].max()
                   for r in range(1, 7) for c in itertools.combinations(range(7), r))  # brute force
        c1, c2 = bipartition(alpha, "single")
        assert sorted(c1 + c2) == list(range(7)) and c1[0] == 0
        assert cross_similarity(alpha, c1, c2) == best


def test_the_authors_complete_linkage_can_miss_the_optimal_bipartition():
    # points on a line, similarity -distance/10; the widest gap is the last one (4.3 -> 6)
    x = np.array([0.0, 1.0, 2.05, 3.15, 4.3, 6.0])
    alpha = -np.abs(x[:, None] - x[None, :]) / 10
    np.fill_diagonal(alpha, 1.0)
    assert bipartition(alpha, "single") == ([0, 1, 2, 3, 4], [5])  # Algorithm 1: cut at the widest gap
    assert bipartition(alpha, "complete") == ([0, 1, 2, 3], [4, 5])  # balanced, but crosses a narrower gap
    assert cross_similarity(alpha, [0, 1, 2, 3, 4], [5]) == pytest.approx(-0.17)
    assert cross_similarity(alpha, [0, 1, 2, 3], [4, 5]) == pytest.approx(-0.115)
    assert bipartition(alpha[:2, :2]) == ([0], [1])
    with pytest.raises(ValueError):
        bipartition(np.ones((1, 1)))


def test_gamma_max_check():
    assert gamma_bound(0.5) == pytest.approx(0.5)  # sqrt((1 - 0.5) / 2)
    assert gamma_bound(-1.0) == pytest.approx(1.0) and gamma_bound(1.0) == 0.0
    assert accept_split(0.5, 0.49) and not accept_split(0.5, 0.5)  # γ_max < bound, strict
    assert accept_split(0.99, 0.0) and not accept_split(1.0, 0.0)  # γ_max = 0: only identical directions block


def test_branch_direction_and_routing():
    d = np.array([[3.0, 4.0], [0.0, 2.0], [0.3, 0.4], [0.0, 0.0]])
    # unit updates (0.6, 0.8) + (0, 1) + (0.6, 0.8), a zero update adds 0
    np.testing.assert_allclose(branch_direction(d), [1.2, 2.6])
    dirs = np.array([[1.0, 0.0], [0.0, 3.0]])
    assert route(np.array([5.0, 1.0]), dirs) == 0 and route(np.array([1.0, 5.0]), dirs) == 1
    assert route(np.array([-5.0, 0.1]), dirs) == 1  # the least dissimilar branch, even when both are negative


def test_cluster_average_is_fedavgs_size_weighted_mean():
    vecs = [np.array(v, np.float32) for v in ([1.0, 0.0], [0.0, 1.0], [3.0, 3.0])]
    # (10·(1,0) + 30·(0,1) + 60·(3,3)) / 100 = (1.9, 2.1); the plain mean would be (4/3, 4/3)
    np.testing.assert_allclose(cluster_average(vecs, [10, 30, 60]), [1.9, 2.1], rtol=1e-6)
    assert cluster_average(vecs, [10, 30, 60]).dtype == np.float32


def test_defaults_are_the_authors_code_and_the_papers_bipartition():
    assert CFLParams() == CFLParams(eps1=0.4, eps2=1.6, gamma_max=0.0, min_rounds=20, min_split_size=3,
                                    linkage="single")


def test_params_check():
    CFLParams().check(3)
    CFLParams(eps1=0.0, eps2=0.0, gamma_max=0.99, min_rounds=0, min_split_size=2, linkage="complete").check(2)
    for bad in (dict(eps1=-0.1), dict(eps1=float("nan")), dict(eps2=float("inf")), dict(eps2=-1.0),
                dict(gamma_max=1.0), dict(gamma_max=-0.1), dict(min_rounds=-1), dict(min_split_size=1),
                dict(min_split_size=4), dict(linkage="ward")):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))}="):
            CFLParams(**bad).check(3)


# ------------------------------------------------------------------------------------------- driver side

def make_server(k=4, n_train=None, **params):
    info = RunInfo(n_clients=k, rounds=5, participation=1.0, seed=0, n_train=n_train or [10] * k)
    values = {"eps1": 1.0, "eps2": 0.5, "min_rounds": 0, "min_split_size": 2, **params}
    return CFLServer(CFLParams(**values), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                     initial=np.zeros(2, np.float32))


def fake_call(deltas: dict, n: dict | None = None, sent: dict | None = None):
    """Clients that 'train' to their cluster model + a fixed update (exact in float32)."""

    def call(step, messages, reduce=None):
        assert step == "train"
        if sent is not None:
            sent.clear()
            sent.update(messages)
        trained = {c: (m["models"]["cluster"] + np.array(deltas[c], np.float32)).astype(np.float32)
                   for c, m in messages.items()}
        return reduce_uploads(reduce, {c: {"weights": trained[c], "trained": trained[c], "n": (n or {}).get(c, 10),
                                           "update_norm": math.hypot(*deltas[c]), "train_loss": 1.0}
                                       for c in messages}, messages)

    return call


AWAY = {0: [1.0, 0.0], 1: [1.0, 0.25], 2: [-1.0, 0.0], 3: [-1.0, -0.25]}  # mean 0, two opposite pairs
N = {0: 10, 1: 30, 2: 10, 3: 10}  # training-set sizes: the weighted mean update is (1/3, 1/12)


def test_the_tree_starts_as_one_cluster_of_everyone():
    srv = make_server(k=3)
    state = srv.state_dict()
    assert state["parent"] == [-1] and state["split_at"] == [-1] and state["node_of"].tolist() == [0, 0, 0]
    assert state["split_stats"].shape == (1, 4) and np.isnan(state["split_stats"]).all()
    assert state["last_alpha"].shape == (0, 0) and state["last_ids"].shape == (0,)
    np.testing.assert_array_equal(state["models"][0], [0.0, 0.0])
    assert np.isnan(srv.artifacts()["similarity"]).all() and srv.artifacts()["similarity"].shape == (3, 3)


@pytest.mark.filterwarnings("error")  # no 0/0 on the way
def test_clients_without_training_data_weigh_nothing():
    srv = make_server(k=2)
    metrics = srv.run_round(Stage("train", 5), 0, [0, 1], fake_call({0: [1.0, 0.0], 1: [0.0, 1.0]}, {0: 0, 1: 0}))
    np.testing.assert_array_equal(srv.models[0], [0.0, 0.0])  # nobody with data: the model stays
    assert math.isnan(metrics["mean_update_norm"]) and srv.split_at == [-1]
    srv.run_round(Stage("train", 5), 1, [0, 1], fake_call({0: [1.0, 0.0], 1: [0.0, 1.0]}, {0: 1, 1: 0}))
    np.testing.assert_array_equal(srv.models[0], [1.0, 0.0])  # only client 0's update counts
    # a split whose half holds no data: that child starts from the parent's model
    srv = make_server(k=3, eps1=2.0)
    srv.run_round(Stage("train", 5), 0, [0, 1, 2],
                  fake_call({0: [1.0, 0.0], 1: [1.0, 0.125], 2: [-1.0, 0.0]}, {0: 10, 1: 1, 2: 0}))
    assert srv.node_of.tolist() == [1, 1, 2]
    np.testing.assert_allclose(srv.models[1], [1.0, 0.125 / 11])  # (10·(1, 0) + 1·(1, 0.125)) / 11
    np.testing.assert_array_equal(srv.models[2], [0.0, 0.0])


def test_a_split_gives_each_half_the_average_of_its_own_updates():
    srv = make_server(n_train=[10, 30, 10, 10])
    metrics = srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY, N))
    np.testing.assert_array_equal(srv.node_of, [1, 1, 2, 2])
    assert srv.parent == [-1, 0, 0] and srv.split_at == [0, -1, -1] and srv.created == [-1, 0, 0]
    np.testing.assert_array_equal(srv.models[0], [0.0, 0.0])  # θ*_c: the pre-split model, kept
    # child {0, 1}: (10·(1, 0) + 30·(1, 0.25)) / 40 = (1, 0.1875); child {2, 3}: ((-1, 0) + (-1, -0.25)) / 2
    np.testing.assert_allclose(srv.models[1], [1.0, 0.1875])
    np.testing.assert_allclose(srv.models[2], [-1.0, -0.125])
    # ||Δθ_c|| = ||(10·(1,0) + 30·(1,.25) + 10·(-1,0) + 10·(-1,-.25)) / 60|| = ||(20/60, 5/60)||
    assert metrics["mean_update_norm"] == pytest.approx(math.hypot(1 / 3, 1 / 12))
    assert metrics["max_update_norm"] == pytest.approx(math.hypot(1.0, 0.25))
    assert (metrics["clusters"], metrics["splits"], metrics["awaiting_routing"]) == (2, 1, 0)
    assert metrics["train_loss"] == 1.0
    alpha_cross = -1 / math.hypot(1.0, 0.25)  # the least opposite cross pair: (1, 0) against (-1, -0.25)
    np.testing.assert_allclose(srv.split_stats[0], [alpha_cross, gamma_bound(alpha_cross),
                                                    metrics["mean_update_norm"], metrics["max_update_norm"]])


def test_no_split_below_the_thresholds_the_warm_up_or_the_size():
    # ||Δθ_c|| = ||(1/3, 1/12)|| = 0.3436 (the plain mean would be 0), max ||Δθ_i|| = ||(1, 0.25)|| = 1.0308,
    # α_cross = -1/1.0308 = -0.9701: γ bound sqrt((1 + 0.9701)/2) = 0.99251
    for params, rnd in ((dict(eps1=0.34), 0), (dict(eps2=1.031), 0), (dict(min_rounds=3), 2),
                        (dict(min_split_size=5), 0), (dict(gamma_max=0.993), 0)):
        srv = make_server(k=5, **params)
        srv.run_round(Stage("train", 5), rnd, [0, 1, 2, 3], fake_call(AWAY, N))
        # no split: one cluster, FedAvg's step: the weighted mean update
        assert srv.split_at == [-1] and srv.node_of.tolist() == [0] * 5, params
        np.testing.assert_allclose(srv.models[0], [1 / 3, 1 / 12], rtol=1e-6)
    # each gate at its edge, opened: the split happens
    for params, rnd in ((dict(eps1=0.35), 0), (dict(eps2=1.03), 0), (dict(min_rounds=3), 3),
                        (dict(min_split_size=4), 0), (dict(gamma_max=0.992), 0)):
        srv = make_server(k=5, **params)
        srv.run_round(Stage("train", 5), rnd, [0, 1, 2, 3], fake_call(AWAY, N))
        assert srv.split_at[0] == rnd, params


def test_a_split_cluster_splits_again_on_new_updates():
    srv = make_server()
    srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY))
    # round 1: inside {0, 1} the updates now disagree, inside {2, 3} they agree
    again = {0: [0.0, 1.0], 1: [0.0, -1.0], 2: [0.5, 0.0], 3: [0.5, 0.0]}
    metrics = srv.run_round(Stage("train", 5), 1, [0, 1, 2, 3], fake_call(again))
    assert srv.parent == [-1, 0, 0, 1, 1] and srv.split_at == [0, 1, -1, -1, -1]
    np.testing.assert_array_equal(srv.node_of, [3, 4, 2, 2])
    np.testing.assert_allclose(srv.models[1], [1.0, 0.125])  # the split node keeps its pre-split model
    np.testing.assert_allclose(srv.models[3], [1.0, 1.125])
    np.testing.assert_allclose(srv.models[4], [1.0, -0.875])
    np.testing.assert_allclose(srv.models[2], [-0.5, -0.125])  # {2, 3} did not split: FedAvg's step
    assert (metrics["clusters"], metrics["splits"]) == (3, 1)
    assert metrics["mean_update_norm"] == pytest.approx(0.5)  # the larger of the two clusters' ||Δθ_c||
    tree = srv.artifacts()["split_tree"]
    assert tree["split_step"].tolist() == [0, 1, -1, -1, -1]
    assert tree["children"].tolist() == ["1 2", "3 4", "", "", ""]
    assert tree["clients_now"].tolist() == [0, 0, 2, 1, 1]
    assert srv.round_artifacts(1)["cluster"].tolist() == [3, 4, 2, 2]


def test_clients_that_missed_a_split_move_down_the_tree_and_idle_clusters_keep_their_model():
    srv = make_server(k=5)
    sent: dict = {}
    metrics = srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY, sent=sent))
    assert srv.node_of.tolist() == [1, 1, 2, 2, 0]  # client 4 missed the split: it stays at node 0
    assert metrics["awaiting_routing"] == 1
    models = [m.copy() for m in srv.models]
    eval_msgs = srv.eval_messages(Stage("train", 5), 0, list(range(5)))
    assert eval_msgs[4]["models"]["cluster"] is srv.models[0]  # evaluated on θ*_c meanwhile
    assert eval_msgs[0] is eval_msgs[1] and eval_msgs[0]["models"]["cluster"] is srv.models[1]
    metrics = srv.run_round(Stage("train", 5), 1, [4], fake_call({4: [-2.0, -1.0]}, sent=sent))
    np.testing.assert_array_equal(sent[4]["models"]["cluster"], models[0])  # trained from θ*_c
    assert srv.node_of[4] == 2  # its update points as {2, 3}'s did
    for a, b in zip(srv.models, models):  # routed only: no cluster took part, every model stays
        np.testing.assert_array_equal(a, b)
    assert metrics["awaiting_routing"] == 0 and math.isnan(metrics["mean_update_norm"]) and metrics["splits"] == 0
    srv.run_round(Stage("train", 5), 2, [3, 4], fake_call({3: [1.0, 1.0], 4: [3.0, 1.0]}, sent=sent))
    np.testing.assert_allclose(srv.models[2], models[2] + [2.0, 1.0])  # now averaged into its cluster


def test_state_round_trip_continues_identically():
    srv = make_server(k=5)
    srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY))
    blob = snapshot.dumps(srv.state_dict())
    other = make_server(k=5)
    other.load_state_dict(snapshot.loads(blob))
    nxt = {0: [0.0, 1.0], 1: [0.0, -1.0], 4: [-1.0, 0.5]}
    for s in (srv, other):
        s.run_round(Stage("train", 5), 1, [0, 1, 4], fake_call(nxt))
    assert same(snapshot.loads(snapshot.dumps(srv.state_dict())), snapshot.loads(snapshot.dumps(other.state_dict())))
    a, b = srv.artifacts(), other.artifacts()
    assert same(a["split_tree"], b["split_tree"]) and same(a["similarity"], b["similarity"])


def test_artifacts_same_cluster_and_last_similarities():
    srv = make_server(k=5)
    srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY))
    art = srv.artifacts()
    np.testing.assert_array_equal(art["same_cluster"], [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 0],
                                                        [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]])
    sim = art["similarity"]
    assert sim.shape == (5, 5) and np.isnan(sim[4]).all() and np.isnan(sim[:, 4]).all()  # client 4 sat out
    np.testing.assert_allclose(sim[:4, :4], cosine_similarities(np.array([AWAY[c] for c in range(4)])))
    assert srv.final_model() is None  # two clusters: no single global model
    one = make_server()
    assert one.final_model() is one.models[0]  # one cluster: FedAvg's global model


def test_similarities_are_formed_where_a_cluster_meets_the_criterion_and_in_the_last_round():
    srv = make_server(k=4, eps1=0.1)  # ||Δθ_c|| = 0.34 > ε1: the criterion never holds
    formed = []
    similarities = srv.similarities
    srv.similarities = lambda *a: formed.append(a[0]) or similarities(*a)
    for rnd in range(4):  # rounds 0-3 of 5: nothing reads α
        srv.run_round(Stage("train", 5), rnd, [0, 1, 2, 3], fake_call(AWAY, N))
    assert formed == [] and srv.last_alpha.shape == (0, 0)
    srv.run_round(Stage("train", 5), 4, [0, 1, 3], fake_call(AWAY, N))  # the last round: reported
    assert formed == [[0, 1, 3]]
    np.testing.assert_allclose(srv.last_alpha, cosine_similarities(np.array([AWAY[c] for c in (0, 1, 3)])))
    assert srv.last_ids.tolist() == [0, 1, 3] and srv.split_at == [-1]
    srv = make_server(k=4)  # the criterion holds in round 0: formed once, for the split
    srv.similarities = lambda *a: formed.append(a[0]) or similarities(*a)
    srv.run_round(Stage("train", 5), 0, [0, 1, 2, 3], fake_call(AWAY, N))
    assert formed[1:] == [[0, 1, 2, 3]] and srv.split_at[0] == 0


# ------------------------------------------------------------------------------------------- client side

def tiny_client():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:20], y[:20]), "val": (x[20:25], y[20:25]), "test": (x[25:], y[25:])}
    return Client(0, splits, lambda: torch.nn.Linear(3, 2), np.zeros(8, np.float32),
                  TrainSettings("classification", 1, 0.1, 8), 0)


def test_client_trains_a_copy_of_its_cluster_model_and_is_evaluated_on_it():
    client, logic = tiny_client(), CFLClient(CFLParams())
    cluster = np.linspace(-1, 1, 8).astype(np.float32)
    up = logic.step_train(client, {}, {"cluster": cluster})
    assert up["n"] == 20 and up["weights"].shape == (8,) and not np.array_equal(up["weights"], cluster)
    np.testing.assert_array_equal(up["trained"], up["weights"])  # θ_i, left for the server beside the host's sum
    step = [float(a) - float(b) for a, b in zip(up["weights"], cluster)]  # ||θ_i - θ_c||, its update's norm
    assert up["update_norm"] == pytest.approx(math.sqrt(sum(v * v for v in step)), rel=1e-12)
    assert client.weights() is None  # no personal model: a working copy was trained
    assert logic.eval_weights({}, {"cluster": cluster}) is cluster


# ------------------------------------------------------------------------------------------- behaviour

def test_before_any_split_cfl_is_fedavg_to_the_bit():
    kw = dict(clients=4, rounds=3, participation=0.75, partition="permutation", groups=2)
    p = prepare(tiny(algo="cfl", params={"min_rounds": 0, "eps2": 1e6}, **kw))  # the criterion never holds
    cfl = Loop(p, LocalRuntime(p)).run()
    q = prepare(tiny(algo="fedavg", **kw))
    fedavg = Loop(q, LocalRuntime(q)).run()
    np.testing.assert_array_equal(cfl.server.final_model(), fedavg.server.final_model())
    for a, b in zip(cfl.history, fedavg.history):
        shared = {k for k in a.keys() & b.keys() if not k.endswith("seconds")}
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}
        assert a["clusters"] == 1 and a["max_update_norm"] > 0


@pytest.mark.parametrize("partition", ["permutation", "label-groups"])
def test_the_split_separates_two_groups(partition):
    # 2 FedAvg rounds, then the criterion is forced (ε1 huge, ε2 = 0) so that the bipartition of real updates
    # is what is tested; groups of 3 are below min_split_size, so only the first cluster may split
    cfg = tiny(algo="cfl", clients=6, rounds=5, partition=partition, groups=2, group_assign="blocks",
               params={"eps1": 1e9, "eps2": 0.0, "min_rounds": 2, "min_split_size": 4})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p)).run()
    groups = np.array(p.info.groups)
    assert [h["clusters"] for h in loop.history] == [1, 1, 2, 2, 2]
    same_cluster = loop.server.artifacts()["same_cluster"].astype(bool)
    np.testing.assert_array_equal(same_cluster, groups[:, None] == groups[None, :])
    sim = loop.server.artifacts()["similarity"]
    same_group = groups[:, None] == groups[None, :]
    assert sim[~same_group].max() < sim[same_group & ~np.eye(6, dtype=bool)].min()
    assert loop.final["test_acc_mean"] > 0.3  # above chance (0.1) on the synthetic data


def test_purity_by_hand():
    assert cluster_purity([0, 0, 1, 1], [0, 0, 1, 1]) == 1.0
    assert cluster_purity([0, 0, 0, 1], [0, 1, 1, 1]) == 0.75
    assert cluster_purity([0, 0, 0, 0], [0, 0, 1, 1]) == 0.5


def test_the_fedfomo_authors_thresholds_split_two_conflicting_groups_within_20_rounds():
    """ε1 = 0.42, ε2 = 1.6 and no warm-up (the FedFomo authors' code's CFL defaults) on a federation whose two
    groups disagree about every label (each its own permutation): FedAvg's mean update shrinks while each
    client's stays large, the criterion fires on its own, and the split follows the groups."""
    cfg = tiny(algo="cfl", clients=8, rounds=20, partition="permutation", groups=2, group_assign="blocks", lr=0.3,
               local_epochs=5, samples_per_client=100, params={"eps1": 0.42, "eps2": 1.6, "min_rounds": 0})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p)).run()
    first = next(i for i, h in enumerate(loop.history) if h["clusters"] > 1)
    before = loop.history[first]
    assert first < 20 and before["splits"] >= 1
    assert cluster_purity(loop.server.artifacts()["cluster"], p.info.groups) >= 0.9
    # the rounds before the split did not meet the criterion, the split round did
    assert all(not (h["mean_update_norm"] < 0.42 and h["max_update_norm"] > 1.6) for h in loop.history[:first])
