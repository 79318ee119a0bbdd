"""The bookkeeping of actors kept between runs (rayfl.actors.pool), without Ray: what they hold counts as free
room when the next run is planned, a run of their shape gets them, another shape does not; and which sessions
may keep them."""

from __future__ import annotations

import pytest

from rayfl.actors.launch import _with_held
from rayfl.actors.pool import ActorPool, KeptClients
from rayfl.actors.resources import DRIVER_CPUS, ActorResources


def pool_of(n: int, cpus: float, gpus: float = 0.0, nodes=None) -> ActorPool:
    pool = ActorPool()
    pool.keep(object(), KeptClients((n, ActorResources(cpus, gpus), 3), [object() for _ in range(n)], [],
                                    nodes or []), "n1")
    return pool


def test_held_is_the_driver_share_and_each_client_actor_by_node():
    pool = pool_of(2, 0.97, 0.25, nodes=["n1", "n2"])
    held = pool.held()
    assert held["n1"] == pytest.approx({"CPU": DRIVER_CPUS + 0.97, "GPU": 0.25})
    assert held["n2"] == pytest.approx({"CPU": 0.97, "GPU": 0.25})
    assert set(held) == {"n1", "n2"}
    assert pool_of(3, 0.5).held()[""] == pytest.approx({"CPU": 1.5, "GPU": 0.0})  # nodes not known


def test_held_resources_count_as_free_on_their_node():
    # 2 CPUs, two 0.97-CPU actors and the 0.05 driver kept: Ray shows 0.01 free; planned as 2 again
    nodes = [{"node_id": "n1", "CPU": 0.01, "GPU": 0.0, "memory": 8.0}]
    assert _with_held(nodes, {"n1": {"CPU": 1.99, "GPU": 0.0}}) == [
        {"node_id": "n1", "CPU": 2.0, "GPU": 0.0, "memory": 8.0}]
    assert _with_held(nodes, {"": {"CPU": 1.0, "GPU": 0.0}})[0]["CPU"] == pytest.approx(1.01)  # the only node
    two = [{**nodes[0]}, {"node_id": "n2", "CPU": 4.0, "GPU": 1.0, "memory": 8.0}]
    assert _with_held(two, {"n2": {"CPU": 1.0, "GPU": 0.5}, "": {"CPU": 3.0, "GPU": 0.0}}) == [
        two[0], {"node_id": "n2", "CPU": 5.0, "GPU": 1.5, "memory": 8.0}]  # an unknown node's: not guessed
    assert _with_held(nodes, None) is nodes


def test_a_run_of_the_kept_shape_takes_them_and_another_shape_does_not():
    pool = pool_of(2, 0.97)
    kept = pool.clients
    assert pool.take_clients((2, ActorResources(0.97, 0.0), 3)) is kept and pool.clients is None
    pool = pool_of(2, 0.97)
    for other in [(3, ActorResources(0.97, 0.0), 3), (2, ActorResources(0.5, 0.0), 3),
                  (2, ActorResources(0.97, 0.0), 0), (2, ActorResources(0.97, 0.1), 3)]:
        pool = pool_of(2, 0.97)
        assert pool.take_clients(other) is None and pool.clients is None  # (killed: no Ray here to kill them)
    driver = pool.driver
    assert pool.take_driver() is driver and pool.driver is None and pool.held() == {}


def test_only_an_api_run_on_a_private_instance_started_or_kept_here_keeps_actors(monkeypatch):
    from rayfl.session import Session

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    session = Session(None, None, keep=True)
    assert session.pool is None  # not connected yet
    session.started = True
    assert session.pool is not None
    assert Session(None, None, keep=False).pool is None  # the command line
    on_cluster = Session(None, None, keep=True)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    on_cluster.started = True
    assert on_cluster.pool is None  # a cluster: its actors end with the run
