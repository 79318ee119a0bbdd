"""User-centric FL (Mestoukirdi et al., 2021, §III): eq. (6) weights against a hand computation, eq. (7) statistics, eq. (5)
aggregation, the FedAvg limit for identical users, and k-means streams recovering the true groups."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.baselines import FedAvgServer
from rayfl.algorithms.usercentric import (UserCentricParams, aggregate, assign_streams, collaboration_weights,
                                          gradient_stats)
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.runtime import LocalRuntime


def run(algo, prepared=None, **over):
    cfg = make_config(None, {"algo": algo, "dataset": "digits", "clients": 4, "rounds": 2, "lr": 0.1, **over})
    p = prepared or prepare(cfg)
    return Loop(p, LocalRuntime(p)).run()


# --------------------------------------------------------------------------------------------- math

def test_weights_match_hand_computation():
    # g1=(0,0), g2=(1,0), g3=(0,2); σ² = (1, 1, 4) so σ = (1, 1, 2); n = (10, 20, 30)
    # Δ12 = 1, Δ13 = 4, Δ23 = 5;  w_ij ∝ n_j exp(-Δ_ij / (2 σ_i σ_j))
    w = collaboration_weights(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]), np.array([1.0, 1.0, 4.0]),
                              np.array([10, 20, 30]))
    e = math.exp
    rows = [[10, 20 * e(-1 / 2), 30 * e(-4 / 4)],
            [10 * e(-1 / 2), 20, 30 * e(-5 / 4)],
            [10 * e(-4 / 4), 20 * e(-5 / 4), 30]]
    expected = np.array([[v / sum(r) for v in r] for r in rows])
    np.testing.assert_allclose(w, expected, rtol=1e-12)
    assert not np.allclose(w, w.T)  # row-stochastic, not symmetric


def test_weights_stable_for_large_discrepancies():
    w = collaboration_weights(np.array([[0.0], [1e4]]), np.array([1e-6, 1e-6]), np.array([5, 5]))
    np.testing.assert_allclose(w, np.eye(2))  # no NaN: log-space softmax


def test_identical_users_give_fedavg_weights_and_average():
    n = np.array([10.0, 30.0, 60.0])
    w = collaboration_weights(np.ones((3, 4)), np.array([0.5, 1.0, 2.0]), n)
    np.testing.assert_allclose(w, np.tile(n / n.sum(), (3, 1)))  # §III-A: Δ = 0 gives FedAvg
    vecs = [np.full(5, v, dtype=np.float32) for v in (1.0, 2.0, 4.0)]
    labels, centroids = assign_streams(w, 0, seed=0)
    out = aggregate(centroids, vecs)
    for row in out:
        np.testing.assert_allclose(row, np.average(vecs, axis=0, weights=n), rtol=1e-6)  # FedAvg's mean


def test_aggregate_is_eq5_on_parameters():
    w = np.array([[0.75, 0.25], [0.5, 0.5]])
    out = aggregate(w, [np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)])
    np.testing.assert_allclose(out, w)
    one = aggregate(np.array([[1.0], [1.0]]), [np.array([3.0, 4.0], np.float32)])  # a single upload
    np.testing.assert_allclose(one, [[3.0, 4.0], [3.0, 4.0]])


def test_streams_full_personalization_and_kmeans_centroids():
    w = np.array([[0.9, 0.1, 0.0, 0.0], [0.8, 0.2, 0.0, 0.0], [0.0, 0.0, 0.7, 0.3], [0.0, 0.0, 0.4, 0.6]])
    for k in (0, 4):
        labels, cent = assign_streams(w, k, seed=0)
        assert labels.tolist() == [0, 1, 2, 3] and np.array_equal(cent, w)
    labels, cent = assign_streams(w, 2, seed=0)
    assert labels[0] == labels[1] != labels[2] == labels[3]
    np.testing.assert_allclose(cent[labels[0]], [0.85, 0.15, 0, 0])  # the cluster's mean row of W
    np.testing.assert_allclose(cent[labels[2]], [0, 0, 0.55, 0.45])
    labels, cent = assign_streams(w, 1, seed=0)
    np.testing.assert_allclose(cent[0], w.mean(0))  # k = 1 is the mean row, not FedAvg


def test_gradient_stats_eq7():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    loss = nn.functional.cross_entropy

    def grad(xb, yb):
        model.zero_grad()
        loss(model(xb), yb).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()

    g, sigma2 = gradient_stats(model, x, y, loss, batch=2, chunk=2)  # full gradient summed over 3 chunks
    full = grad(x, y)
    np.testing.assert_allclose(g, full.numpy(), rtol=1e-5, atol=1e-7)
    # K = floor(5 / 2) = 2 batches of n_k = 2; the fifth sample is dropped from (7) only
    expected = np.mean([float((grad(x[i:i + 2], y[i:i + 2]) - full).pow(2).sum()) for i in (0, 2)])
    assert sigma2 == pytest.approx(expected, rel=1e-6)
    _, two = gradient_stats(model, x[:2], y[:2], loss, batch=32)  # two samples: n_k halves to 1, K = 2
    pair = grad(x[:2], y[:2])
    expected = np.mean([float((grad(x[i:i + 1], y[i:i + 1]) - pair).pow(2).sum()) for i in (0, 1)])
    assert two == pytest.approx(expected, rel=1e-6) and two > 0
    assert gradient_stats(model, x[:1], y[:1], loss, batch=32)[1] == 0.0  # one sample: no spread (local only)


def test_params_check():
    UserCentricParams(streams=4).check(4)
    with pytest.raises(ValueError, match="streams=5"):
        UserCentricParams(streams=5).check(4)
    with pytest.raises(ValueError, match="sigma_batch=-1"):
        UserCentricParams(sigma_batch=-1).check(4)


# --------------------------------------------------------------------------------------------- behaviour

def test_identical_users_train_exactly_like_fedavg():
    preps = []
    for algo in ("usercentric", "fedavg"):
        p = prepare(make_config(None, {"algo": algo, "dataset": "digits", "partition": "iid", "clients": 4,
                                       "rounds": 2, "lr": 0.1}))
        p.federation.clients = [p.federation.clients[0]] * 4  # four users holding the same data
        p.info.n_train = [p.info.n_train[0]] * 4
        preps.append(p)
    uc, fa = (Loop(p, LocalRuntime(p)).run() for p in preps)
    np.testing.assert_allclose(uc.server.w, 0.25)
    assert isinstance(fa.server, FedAvgServer)
    fedavg_global = fa.runtime.get([fa.server.final_model()])[0]  # FedAvg's clients keep no model of their own
    assert len(uc.runtime.client_vectors()) == 4
    for c, v in uc.runtime.client_vectors().items():
        np.testing.assert_allclose(v, fedavg_global, atol=1e-5)
    assert uc.final["test_acc_mean"] == pytest.approx(fa.final["test_acc_mean"])


@pytest.mark.parametrize("partition,groups", [("rotation", 2), ("permutation", 4)])
def test_kmeans_with_true_k_recovers_groups(partition, groups):
    loop = run("usercentric", partition=partition, groups=groups, clients=8, rounds=1,
               params={"streams": groups})
    truth = np.array(loop.prepared.info.groups)
    labels = loop.server.labels
    for g in range(groups):  # one stream per true group, and each group in one stream
        assert len(set(labels[truth == g])) == 1
    assert len(set(labels)) == groups
    assert loop.setup_metrics["streams_ari_groups"] == 1.0
    assert loop.setup_metrics["silhouette_best_k"] == groups
    assert loop.setup_metrics["streams"] == groups  # k streams, not one per user
    assert sorted(loop.server.silhouette) == list(range(2, 8))  # k = 2 .. m - 1 with m = 8 users
    w = loop.server.w
    same = truth[:, None] == truth[None, :]
    assert w[same].mean() > w[~same].mean()  # more weight on same-group users
    art = loop.server.artifacts()
    assert art["W"].shape == (8, 8) and list(art["streams"]["stream"]) == labels.tolist()
    assert art["stream_weights"].shape == (groups, 8)
    assert "test_acc_worst" in loop.final


def test_server_round_aggregates_with_the_rows_of_w():
    """Eq. 5: user i's next model is Σ_j w_ij θ_j (its ROW of W), not Σ_j w_ji θ_j."""
    from rayfl.algorithms.base import RunInfo, Stage
    from rayfl.algorithms.usercentric import UserCentricServer

    info = RunInfo(n_clients=3, rounds=1, participation=1.0, seed=0, n_train=[5, 5, 5])
    srv = UserCentricServer(UserCentricParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                            initial=np.zeros(2, np.float32))
    w = np.array([[0.7, 0.2, 0.1], [0.0, 0.5, 0.5], [0.3, 0.3, 0.4]])  # not symmetric
    srv.w, (srv.labels, srv.centroids) = w, assign_streams(w, 0, seed=0)
    srv.stream_refs = [srv.initial] * 3
    thetas = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [2.0, 2.0]}
    ups = lambda step, msgs: {c: {"weights": np.array(thetas[c], np.float32), "n": 5,  # noqa: E731
                                  "train_loss": 0.0} for c in msgs}
    srv.run_round(Stage("train", 1), 0, [0, 1, 2], ups)
    for i in range(3):
        expected = sum(w[i, j] * np.array(thetas[j]) for j in range(3))
        np.testing.assert_allclose(srv.stream_refs[srv.labels[i]], expected, rtol=1e-6)
    assert "stream_weights" not in srv.artifacts()  # k = m: the streams' weights are W itself
    assert [st.sample for st in srv.stages()] == [False]  # all m users every round (eq. 5 sums over all j)
    srv.labels, srv.centroids = assign_streams(w, 2, seed=0)
    assert srv.artifacts()["stream_weights"].shape == (2, 3)


def test_defaults():
    """k = m streams (full personalization) and n_k = the run's batch size unless set."""
    p = UserCentricParams()
    assert (p.streams, p.sigma_batch) == (0, 0)


def test_sigma_batch_defaults_to_the_runs_batch_size(monkeypatch):
    """Eq. 7's n_k: ``sigma_batch`` when set, else the run's batch size (0 is the default)."""
    from types import SimpleNamespace

    from rayfl.algorithms import usercentric
    from rayfl.algorithms.usercentric import UserCentricClient

    seen = []

    def fake_stats(model, x, y, loss_fn, batch):
        seen.append(batch)
        return np.zeros(2), 0.0

    monkeypatch.setattr(usercentric, "gradient_stats", fake_stats)
    client = SimpleNamespace(new_model=lambda vec: None, splits={"train": (None, None)}, share=lambda g: g,
                             n=lambda: 5, settings=SimpleNamespace(batch_size=32, task="classification"))
    for sigma_batch in (0, 8):
        UserCentricClient(UserCentricParams(sigma_batch=sigma_batch)).step_stats(client, {}, {"theta": None})
    assert seen == [32, 8]


def test_silhouette_scores_cover_k_2_to_10_at_most():
    from rayfl.algorithms.usercentric import silhouette_scores

    w = np.random.default_rng(0).dirichlet(np.ones(14), size=14)  # 14 distinct users
    assert sorted(silhouette_scores(w, seed=0)) == list(range(2, 11))  # min(m - 1, 10) = 10
