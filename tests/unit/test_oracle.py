"""The oracle (Mestoukirdi et al., user-centric FL, Fig. 2): one FedAvg per known latent group. Each group's model
is the size-weighted mean of its sampled members on hand-made uploads, a group with no member sampled keeps its
model, each client is evaluated on its own group's model, the state round-trips, a partition without groups is
refused, and end to end it beats FedAvg where the groups' tasks conflict (label permutations)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny
from rayfl.algorithms import get_algorithm
from rayfl.algorithms.base import RunInfo, Stage
from rayfl.algorithms.baselines import FedAvgClient
from rayfl.algorithms.oracle import GROUPED_PARTITIONS, OracleParams, OracleServer
from rayfl.config import UserError
from rayfl.data import build_federation, load_dataset
from rayfl.data.partition import PARTITIONS
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime

STAGE = Stage("train", 3)
GROUPS = [0, 1, 0, 1, 1]  # clients 0 and 2 in group 0; 1, 3 and 4 in group 1
VECS = {0: [1.0, 0.0], 1: [0.0, 4.0], 2: [4.0, 3.0], 3: [2.0, 0.0], 4: [8.0, 8.0]}
SIZES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 6}
LOSS = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}


def make_server(groups=GROUPS, n=None):
    n = len(groups) if n is None else n
    info = RunInfo(n_clients=n, rounds=3, participation=1.0, seed=0, n_train=[1] * n, groups=groups)
    return OracleServer(OracleParams(), info, put=lambda v: v, get=list, rng=np.random.default_rng(0),
                        initial=np.zeros(2, np.float32))


def fake_call(log):
    def call(step, msgs, reduce=None):  # the reduction the engine would run inside the client actors
        log.append((step, msgs))
        return reduce_uploads(reduce, {c: {"weights": np.array(VECS[c], np.float32), "n": SIZES[c],
                                           "train_loss": LOSS[c]} for c in msgs}, msgs)
    return call


def test_each_group_averages_its_own_sampled_members_weighted_by_size():
    srv, log = make_server(), []
    metrics = srv.run_round(STAGE, 0, [0, 1, 2, 4], fake_call(log))
    # group 0: (1·(1, 0) + 3·(4, 3)) / 4 = (3.25, 2.25); group 1, client 3 not sampled: (2·(0, 4) + 6·(8, 8)) / 8
    # = (6, 7); the plain means would be (2.5, 1.5) and (4, 6)
    np.testing.assert_allclose(srv.fedavg[0].global_ref, [3.25, 2.25])
    np.testing.assert_allclose(srv.fedavg[1].global_ref, [6.0, 7.0])
    assert [(step, sorted(msgs)) for step, msgs in log] == [("train", [0, 1, 2, 4])]  # the groups train at once
    for _, msgs in log:  # every member trains from its group's model, here still the initial one
        for msg in msgs.values():
            np.testing.assert_array_equal(msg["models"]["global"], np.zeros(2))
        assert msgs[0] is msgs[2] and msgs[1] is msgs[4] and msgs[0] is not msgs[1]  # one message per group
    # the round's training loss over all participants, by size: (1·1 + 2·2 + 3·3 + 6·5) / 12
    assert metrics["train_loss"] == pytest.approx(44 / 12)

    log.clear()  # next round: only group 0 is sampled; it starts from its own model, group 1 keeps its model
    srv.run_round(STAGE, 1, [2], fake_call(log))
    (step, msgs), = log
    np.testing.assert_array_equal(msgs[2]["models"]["global"], [3.25, 2.25])
    np.testing.assert_allclose(srv.fedavg[0].global_ref, [4.0, 3.0])
    np.testing.assert_allclose(srv.fedavg[1].global_ref, [6.0, 7.0])


def test_each_client_is_evaluated_on_its_own_groups_model():
    srv = make_server()
    srv.run_round(STAGE, 0, [0, 1, 2, 3, 4], fake_call([]))
    msgs = srv.eval_messages(STAGE, 0, [0, 1, 2, 3, 4])
    assert sorted(msgs) == [0, 1, 2, 3, 4]
    for c, msg in msgs.items():
        assert msg["models"]["global"] is srv.fedavg[GROUPS[c]].global_ref
    assert msgs[0] is msgs[2] and msgs[1] is msgs[3] is msgs[4]  # one message per group: one evaluation pass
    assert not np.array_equal(srv.fedavg[0].global_ref, srv.fedavg[1].global_ref)
    assert get_algorithm("oracle").ClientLogic is FedAvgClient  # trains from, and evaluates, the message's model


def test_state_holds_every_groups_model():
    srv = make_server()
    srv.run_round(STAGE, 0, [0, 1, 2, 3, 4], fake_call([]))
    state = srv.state_dict()
    assert state["groups"].shape == (2, 2)
    back = make_server()
    back.load_state_dict(state)
    for g in (0, 1):
        np.testing.assert_array_equal(back.fedavg[g].global_ref, srv.fedavg[g].global_ref)
    assert srv.final_model() is None  # no single global model to save


def test_groups_need_not_be_numbered_from_zero_or_in_order():
    srv, log = make_server([3, 1, 3]), []
    srv.run_round(STAGE, 0, [0, 1, 2], fake_call(log))
    assert sorted(srv.fedavg) == [1, 3]
    np.testing.assert_allclose(srv.fedavg[3].global_ref, [(1 * 1 + 3 * 4) / 4, (3 * 3) / 4])
    np.testing.assert_allclose(srv.fedavg[1].global_ref, VECS[1])


def test_a_partition_without_groups_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^partition=iid: the oracle needs a partition with latent groups; "
                                         r"allowed: latent, label-groups, rotation, permutation$"):
        OracleParams().check_config(tiny(partition="iid"))
    with pytest.raises(UserError, match="^partition=dirichlet: the oracle needs"):
        tiny(algo="oracle", partition="dirichlet").check()
    for name in GROUPED_PARTITIONS:
        OracleParams().check_config(tiny(partition=name, dataset="digits"))
    with pytest.raises(ValueError, match="latent groups"):
        make_server(None, n=3)


def test_the_grouped_partitions_are_those_that_give_groups():
    for name in set(PARTITIONS) - {"natural"}:  # natural: the data's own clients (tests/integration/test_datasets_custom.py)
        cfg = tiny(partition=name, dataset="sine" if name == "latent" else "digits", clients=4, groups=2)
        fed = build_federation(cfg, load_dataset(cfg))
        assert (fed.clients[0].group is not None) == (name in GROUPED_PARTITIONS), name


def test_the_oracle_beats_fedavg_when_the_groups_tasks_conflict():
    def run(algo):
        p = prepare(tiny(algo=algo, clients=6, rounds=6, partition="permutation", groups=2))
        return p, Loop(p, LocalRuntime(p)).run()

    _, fedavg = run("fedavg")
    p, oracle = run("oracle")
    assert sorted(set(p.info.groups)) == [0, 1]
    assert oracle.final["test_acc_mean"] > fedavg.final["test_acc_mean"] + 0.2
    assert oracle.final["test_acc_mean"] > 0.5  # 10 classes: chance is 0.1
