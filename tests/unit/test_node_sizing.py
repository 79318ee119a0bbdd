"""Client actors are sized and checked node by node: an actor lives on one node, and the driver's share sits on
one of them. Hand-built node shapes (no Ray): the default sizing of the 2x2-CPU, 2x4-CPU and 0-CPU head +
2x1-CPU clusters, checked by placing the actors as a scheduler would (every node the driver might land on
tried, the actors then put first-fit), and the one line a request that cannot fit gets."""

from __future__ import annotations

import pytest

from rayfl.actors.resources import DRIVER_CPUS, ActorResources, check_fits, preflight
from rayfl.config import UserError, make_config

GiB = 2**30


def nodes(*cpus, gpus=0.0, memory=16 * GiB) -> list[dict]:
    return [{"CPU": float(c), "GPU": float(gpus), "memory": memory} for c in cpus]


def places_all(shape: list[dict], n_actors: int, res: ActorResources) -> bool:
    """Whether the driver and ``n_actors`` actors of ``res`` are all placed, wherever the driver lands: a plain
    first-fit placement on a copy of the free resources (independent of the code under test)."""
    for d in range(len(shape)):
        free = [[n["CPU"], n.get("GPU", 0.0)] for n in shape]
        if free[d][0] < DRIVER_CPUS - 1e-9:
            continue  # the driver cannot land here
        free[d][0] -= DRIVER_CPUS
        placed = 0
        for _ in range(n_actors):
            for slot in free:
                if slot[0] >= res.num_cpus - 1e-9 and slot[1] >= res.num_gpus - 1e-9:
                    slot[0] -= res.num_cpus
                    slot[1] -= res.num_gpus
                    placed += 1
                    break
        if placed < n_actors:
            return False
    return True


@pytest.mark.parametrize("shape, clients, cpus", [
    (nodes(0, 2, 2), 4, 0.97),  # (2 - 0.05) / 2 per actor, two on each worker
    (nodes(0, 4, 4), 8, 0.98),  # (4 - 0.05) / 4 = 0.9875, floored to the 0.01 grain
    (nodes(0, 1, 1), 2, 0.95),  # the 0-CPU head takes nothing; one actor beside the driver on a 1-CPU worker
    (nodes(2), 10, 0.97),  # one 2-CPU machine: two actors of five clients
])
def test_default_sizing_fits_each_node_with_the_driver(shape, clients, cpus):
    cfg = make_config(None, {"clients": clients})
    n_actors, res = preflight(cfg, shape)
    workers = [n for n in shape if n["CPU"] > 0]
    assert n_actors == min(clients, int(sum(n["CPU"] for n in workers)))  # one actor per CPU (torch_threads 1)
    assert res.num_cpus == pytest.approx(cpus) and res.num_gpus == 0
    assert places_all(shape, n_actors, res)
    # the cluster-wide share the totals would give ((total - driver) / actors) does not place them all
    total = sum(n["CPU"] for n in shape)
    naive = ActorResources(round(int((total - DRIVER_CPUS) / n_actors * 100) / 100, 2), 0.0)
    if naive.num_cpus > res.num_cpus:
        assert not places_all(shape, n_actors, naive)
        with pytest.raises(UserError):
            check_fits(naive, n_actors, shape, clients)


def test_gpu_actors_go_to_the_gpu_nodes_only():
    shape = [{"CPU": 1.0, "GPU": 0.0}, {"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    n_actors, res = preflight(make_config(None, {"clients": 4}), shape)
    assert n_actors == 4 and res.num_gpus == 1.0 and res.num_cpus == pytest.approx(0.97)
    assert places_all(shape, n_actors, res)


def test_a_request_that_cannot_fit_is_one_line_naming_the_nodes_and_the_flag():
    shape = nodes(0, 2, 2)
    with pytest.raises(UserError) as e:
        preflight(make_config(None, {"clients": 4, "clients_per_actor": 1, "cpus_per_actor": 1.5}), shape)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cpus_per_actor=1.5: 4 client actors of 1.5 CPU each")
    assert "free on the nodes: 2 CPU x2, 0 CPU" in msg and "at most 2 fit" in msg
    assert "set clients_per_actor >= 2" in msg
    assert not places_all(shape, 4, ActorResources(1.5, 0.0)) and places_all(shape, 2, ActorResources(1.5, 0.0))
    with pytest.raises(UserError, match=r"^gpus_per_actor=0.5: 4 client actors of 0.1 CPU and 0.5 GPU"):
        check_fits(ActorResources(0.1, 0.5), 4, [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 0.0}], 4)
    with pytest.raises(UserError, match=r"^100 client actors need about 50 GiB .* set clients_per_actor >= 4"):
        check_fits(ActorResources(0.01, 0.0), 100, nodes(2), n_clients=100)


def test_no_node_with_room_for_the_driver_fits_nothing():
    with pytest.raises(UserError, match="at most 0 fit"):
        check_fits(ActorResources(0.01, 0.0), 1, nodes(0.04, 0.04))
    check_fits(ActorResources(0.01, 0.0), 1, nodes(0.04, 0.06))
