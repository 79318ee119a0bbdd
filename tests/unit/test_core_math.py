"""Ray-free unit tests of the core's math: weight vectors, averaging, the summary across clients,
host assignment, resources and config checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayfl.actors.resources import ActorResources, check_fits, plan_actor_resources
from rayfl.config import UserError, make_config
from rayfl.metrics import round_summary, summarize
from rayfl.models import build_model
from rayfl.runtime import assign_hosts, group_by_host
from rayfl.training import load_vector, to_vector


def test_vector_round_trip_is_exact():
    torch.manual_seed(0)
    a, b = build_model("mlp-small", (1, 8, 8), 10), build_model("mlp-small", (1, 8, 8), 10)
    v = to_vector(a)
    assert v.dtype == np.float32 and v.size == sum(p.numel() for p in a.parameters())
    load_vector(b, v)
    np.testing.assert_array_equal(to_vector(b), v)
    with pytest.raises(ValueError):
        load_vector(b, v[:-1])


def test_summary_by_hand():
    s = summarize([0.5, 1.0, 0.75, 0.25], weights=[1, 1, 2, 4])
    assert s["mean"] == pytest.approx(0.625)
    assert s["weighted_mean"] == pytest.approx((0.5 + 1.0 + 1.5 + 1.0) / 8)
    assert s["std"] == pytest.approx(np.std([0.5, 1.0, 0.75, 0.25], ddof=1))
    assert s["worst"] == 0.25
    assert s["bottom10_mean"] == 0.25  # ceil(10% of 4) = 1 client
    losses = summarize([0.1, 0.9, 0.5], higher_is_better=False)
    assert losses["worst"] == 0.9 and losses["bottom10_mean"] == 0.9


def test_bottom10_uses_ceil_of_tenth_of_clients():
    vals = list(np.linspace(0, 1, 20))  # 2 clients make the bottom 10%
    assert summarize(vals)["bottom10_mean"] == pytest.approx((vals[0] + vals[1]) / 2)


def test_summary_leaves_out_empty_splits():
    s = summarize([0.5, float("nan"), 1.0])
    assert s["mean"] == 0.75 and s["worst"] == 0.5


def test_round_summary_keys():
    per_client = {0: {"test_acc": 1.0, "test_loss": 0.1, "n_test": 10, "val_acc": 0.5, "val_loss": 1.0, "n_val": 5},
                  1: {"test_acc": 0.0, "test_loss": 2.0, "n_test": 30, "val_acc": 0.5, "val_loss": 1.0, "n_val": 5}}
    out = round_summary(per_client)
    assert out["test_acc_mean"] == 0.5
    assert out["test_acc_weighted_mean"] == pytest.approx(0.25)
    assert out["test_loss_worst"] == 2.0
    assert out["val_acc_std"] == 0.0


def test_assign_hosts_and_grouping():
    assert assign_hosts(5, 3) == [[0, 1], [2], [3, 4]]  # spread evenly: sizes differ by at most one
    assert assign_hosts(3, 3) == [[0], [1], [2]]
    assert assign_hosts(3, 8) == [[0], [1], [2]]  # never an empty host
    host_of = {0: 0, 1: 0, 2: 1}
    assert group_by_host({2: "c", 0: "a"}, host_of) == {0: [(0, "a")], 1: [(2, "c")]}


def test_auto_placement_counts_slots_in_a_cluster_description():
    from rayfl.actors.resources import n_actors_for, slots
    from rayfl.runtime import hosts_for

    GiB = 2**30
    ten, thousand = make_config(None, {"clients": 10}), make_config(None, {"clients": 1000})
    assert ten.clients_per_actor == "auto"
    assert slots(ten, {"CPU": 2.0, "memory": 15 * GiB}) == 2  # this box: one actor per core
    assert n_actors_for(ten, {"CPU": 2.0, "memory": 15 * GiB}) == 2
    assert n_actors_for(ten, {"CPU": 1.95}) == 2  # a sweep's share, less the trial's own sliver
    assert n_actors_for(ten, {"CPU": 64.0, "GPU": 4.0, "memory": 256 * GiB}) == 10  # a slot for each client
    assert n_actors_for(thousand, {"CPU": 64.0, "memory": 8 * GiB}) == 16  # memory-bound: 0.5 GiB an actor
    assert n_actors_for(make_config(None, {"clients": 10, "torch_threads": 2}), {"CPU": 8.0}) == 4
    assert n_actors_for(make_config(None, {"clients": 10, "clients_per_actor": 3}), {"CPU": 64.0}) == 4
    assert [len(b) for b in hosts_for(thousand, 2)] == [500, 500]
    assert make_config(None, {"clients_per_actor": "4"}).clients_per_actor == 4
    with pytest.raises(UserError, match="clients_per_actor='many': must be auto or an integer >= 1"):
        make_config(None, {"clients_per_actor": "many"}).check()


def test_resources_share_the_cluster():
    cfg = make_config(None, {"clients": 8})
    r = plan_actor_resources(cfg, 8, {"CPU": 2.0})
    assert r.num_gpus == 0 and 0 < r.num_cpus * 8 <= 2.0
    g = plan_actor_resources(cfg, 8, {"CPU": 16.0, "GPU": 2.0})
    assert g.num_gpus == pytest.approx(0.25) and g.num_cpus == 1.0  # torch_threads caps CPUs
    fixed = plan_actor_resources(make_config(None, {"gpus_per_actor": 0.5, "cpus_per_actor": 0.3}), 8, {"CPU": 2})
    assert (fixed.num_cpus, fixed.num_gpus) == (0.3, 0.5)


@pytest.mark.parametrize("overrides, fragment", [
    ({"algo": "fedsgd"}, "algo='fedsgd': unknown; allowed:"),
    ({"dataset": "imagenet"}, "dataset='imagenet': unknown"),
    ({"partition": "zipf"}, "partition='zipf': unknown"),
    ({"model": "resnet"}, "model='resnet': unknown"),
    ({"clients": 0}, "clients=0: must be an integer >= 1"),
    ({"rounds": 0}, "rounds=0"),
    ({"participation": 0}, "participation=0"),
    ({"participation": 1.5}, "participation=1.5: must be in (0, 1]"),
    ({"val_frac": 1.2}, "val_frac=1.2"),
    ({"val_frac": 0.5, "test_frac": 0.5}, "val_frac + test_frac"),
    ({"data_root": "/no/such/dir"}, "data_root='/no/such/dir': no such directory"),
    ({"params": {"nope": 1}}, "nope=1: unknown parameter"),
    ({"lr": -1}, "lr=-1"),
])
def test_config_errors_name_the_value(overrides, fragment):
    with pytest.raises(UserError) as e:
        make_config(None, overrides).check()
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("clients: 7\nlr: '0.2'\nparams: {ft_epochs: 2}\nalgo: fedavg-ft\n")
    cfg = make_config(str(f), {"clients": 5, "params": {"ft_lr": 0.01}})
    assert (cfg.clients, cfg.lr, cfg.params) == (5, 0.2, {"ft_epochs": 2, "ft_lr": 0.01})
    cfg.check()
    flat = cfg.to_flat()
    assert flat["param.ft_epochs"] == 2 and flat["clients"] == 5 and "params" not in flat
    f.write_text("clinets: 3\n")
    with pytest.raises(UserError, match="unknown config key 'clinets'"):
        make_config(str(f))
    f.write_text("clients: [1\n")
    with pytest.raises(UserError, match="not valid YAML"):
        make_config(str(f))
    with pytest.raises(UserError, match="rounds='many': must be an integer"):
        make_config(None, {"rounds": "many"})


def test_round_summary_leaves_out_clients_without_a_value():
    """A record without a split's metric (a missing key or NaN) is left out of that metric's statistics only;
    sizes weigh the rest, a record without a size not at all (by hand: accuracies 0.5 and 1.0 with 2 and 6
    test samples)."""
    per_client = {3: {"test_acc": 1.0, "test_loss": 0.2, "n_test": 6},
                  1: {"test_acc": 0.5, "test_loss": 0.4, "n_test": 2},
                  2: {"test_loss": 0.9},  # no size: weight 0
                  0: {"test_acc": math.nan, "test_loss": 0.3, "n_test": 5}}
    out = round_summary(per_client)
    assert out["test_acc_mean"] == 0.75 and out["test_acc_weighted_mean"] == pytest.approx(7 / 8)
    assert out["test_acc_worst"] == 0.5 and out["test_acc_std"] == pytest.approx(0.5 ** 0.5 / 2)
    assert out["test_loss_mean"] == pytest.approx(0.45) and out["test_loss_worst"] == 0.9
    assert out["test_loss_weighted_mean"] == pytest.approx((0.2 * 6 + 0.4 * 2 + 0.3 * 5) / 13)


def test_nan_free_summary_for_regression():
    out = round_summary({0: {"test_loss": 0.5, "test_acc": math.nan, "n_test": 3}})
    assert "test_acc_mean" not in out and out["test_loss_mean"] == 0.5


def test_requests_the_cluster_cannot_hold_are_user_errors():
    check_fits(ActorResources(0.5, 0.0), 3, {"CPU": 2.0})
    with pytest.raises(UserError, match=r"cpus_per_actor=1: 3 client actors of 1 CPU each, beside the driver's "
                                        r"0.05 CPU, do not fit \(free on the nodes: 2 CPU;.*at most 1 fit"):
        check_fits(ActorResources(1.0, 0.0), 3, {"CPU": 2.0})
    with pytest.raises(UserError, match="gpus_per_actor=0.5: 2 client actors of 0.1 CPU and 0.5 GPU each"):
        check_fits(ActorResources(0.1, 0.5), 2, {"CPU": 2.0})
    with pytest.raises(UserError, match=r"100 client actors need about 50 GiB .* clients_per_actor >= 4"):
        check_fits(ActorResources(0.01, 0.0), 100, {"CPU": 2.0, "memory": 16 * 2**30}, n_clients=100)
    check_fits(ActorResources(0.01, 0.0), 25, {"CPU": 2.0, "memory": 16 * 2**30}, n_clients=100)


def test_host_resolves_every_named_handle_in_one_batch():
    from types import SimpleNamespace

    from rayfl.host import ClientHost

    batches = []
    fake = SimpleNamespace(resolve=lambda hs: batches.append(list(hs)) or [h * 10 for h in hs])
    maps = [{"global": 1, "peers": [2, 3], "by_owner": {7: 4}}, {"peers": [], "by_owner": {}}, {}]
    out = ClientHost._resolve_models(fake, maps)
    assert batches == [[1, 2, 3, 4]]
    assert out == [{"global": 10, "peers": [20, 30], "by_owner": {7: 40}}, {"peers": [], "by_owner": {}}, {}]


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_flat_sgd_steps_like_torch_sgd(momentum, weight_decay):
    """Three minibatch steps of FlatSGD on a flattened model give torch.optim.SGD's weights."""
    from torch import nn

    from rayfl.training import FlatSGD, flatten, train_epochs

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))  # noqa: E731
    ref = make()
    flat = flatten(load_vector(make(), to_vector(ref)))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    opts = [torch.optim.SGD(ref.parameters(), lr=0.3, momentum=momentum, weight_decay=weight_decay),
            FlatSGD(flat, lr=0.3, momentum=momentum, weight_decay=weight_decay)]
    losses = [train_epochs(m, x, y, 1, 4, o, torch.nn.functional.cross_entropy, torch.Generator().manual_seed(1))
              for m, o in zip((ref, flat), opts)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert not np.allclose(to_vector(ref), to_vector(make()))  # it did move
    np.testing.assert_allclose(to_vector(flat), to_vector(ref), rtol=1e-5, atol=1e-6)
    # a second optimizer on the same module (the next client) reuses its gradient buffer; one made after
    # something set the grads to None (a torch optimizer's zero_grad) links a new one: both still equal SGD
    for unlink in (False, True):
        if unlink:
            flat.zero_grad(set_to_none=True)
        opts = [torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay),
                FlatSGD(flat, lr=0.1, momentum=momentum, weight_decay=weight_decay)]
        for m, o in zip((ref, flat), opts):
            train_epochs(m, x, y, 1, 4, o, torch.nn.functional.cross_entropy, torch.Generator().manual_seed(2))
        np.testing.assert_allclose(to_vector(flat), to_vector(ref), rtol=1e-5, atol=1e-6)


def test_flat_model_loads_and_reads_one_vector():
    from torch import nn

    from rayfl.training import flatten

    model = flatten(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    vec = np.arange(to_vector(model).size, dtype=np.float32)
    load_vector(model, vec)
    np.testing.assert_array_equal(to_vector(model), vec)
    assert model[0].weight.data_ptr() == model._rayfl_flat.data_ptr()  # parameters are views of one tensor
    np.testing.assert_array_equal(model[1].running_mean.numpy(), vec[12:14])  # buffers too, in state_dict order


def test_preflight_refuses_what_this_machine_cannot_hold_before_ray_starts():
    from rayfl.actors.resources import preflight

    n, res = preflight(make_config(None, {"clients": 10}), {"CPU": 2.0, "memory": 15 * 2**30})
    assert n == 2 and res.num_cpus == pytest.approx(0.97)
    with pytest.raises(UserError, match=r"200 client actors need about 100 GiB .* clients_per_actor >= 7"):
        preflight(make_config(None, {"clients": 200, "clients_per_actor": 1, "cpus_per_actor": 0.005}),
                  {"CPU": 2.0, "memory": 15 * 2**30})
    assert preflight(make_config(None, {"clients": 200}))[0] >= 1  # this machine, described before Ray starts


def test_small_splits_evaluated_in_one_pass_equal_separate_evaluations():
    """Client.evaluate joins small splits into one forward pass; each split's loss and accuracy equal
    training.evaluate on that split alone (classification and regression, an empty split included)."""
    import torch

    from rayfl import training
    from rayfl.client import Client, TrainSettings

    torch.manual_seed(0)
    for task, out_dim, y_of in (("classification", 4, lambda n: torch.randint(0, 4, (n,))),
                                ("regression", 2, lambda n: torch.randn(n, 2))):
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, out_dim))
        splits = {s: (torch.randn(n, 3), y_of(n)) for s, n in (("train", 5), ("val", 7), ("test", 11), ("empty", 0))}
        client = Client(0, splits, lambda: model, None, TrainSettings(task, 1, 0.1, 4), seed=0)
        rec = client.evaluate(model, ("val", "test", "empty"))
        for s in ("val", "test", "empty"):
            loss, acc = training.evaluate(model, *splits[s], task)
            assert rec[f"n_{s}"] == splits[s][0].shape[0]
            np.testing.assert_allclose([rec[f"{s}_loss"], rec[f"{s}_acc"]], [loss, acc], rtol=1e-6, equal_nan=True)
        assert rec["val_loss"] != rec["test_loss"]  # the segments are told apart


def test_an_evaluation_pass_keeps_its_largest_activation_within_the_budget():
    """pass_size: the largest tensor of a one-sample forward (input included), counted by hand, bounds the
    samples of a CPU pass; the limit bounds it too, and other devices get the limit."""
    from rayfl import training

    lenet = build_model("lenet5", (1, 28, 28), 10)  # conv 5x5 of 28x28 to 6 channels: 6*24*24 per sample
    mlp = build_model("mlp-784-200", (1, 28, 28), 10)  # the input, 784, is larger than the hidden 200
    x = torch.zeros(3, 1, 28, 28)
    assert training.largest_activation(lenet, x[:1]) == 6 * 24 * 24
    assert training.largest_activation(mlp, x[:1]) == 784
    assert training.largest_activation(torch.nn.Linear(100, 5), torch.zeros(1, 100)) == 100  # the input itself
    assert training.pass_size(lenet, x, 4096) == (8 << 20) // (4 * 3456) == 606
    assert training.pass_size(mlp, x, 4096) == (8 << 20) // (4 * 784) == 2674
    assert training.pass_size(mlp, x, 1024) == 1024
    assert training.pass_size(lenet, torch.zeros(3, 1, 28, 28, device="meta"), 4096) == 4096


def test_evaluation_passes_follow_the_pass_size_and_equal_one_pass(monkeypatch):
    """training.evaluate's default passes are pass_size samples each; the result is that of a single pass."""
    from rayfl import training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x, y = torch.randn(30, 3), torch.randint(0, 4, (30,))
    whole = training.evaluate(model, x, y, "classification", batch_size=30)
    monkeypatch.setattr(training, "PASS_BYTES", 4 * 8 * 7)  # 8 floats a sample (the hidden layer): 7 a pass
    passes = []
    hook = model.register_forward_hook(lambda m, inp, out: passes.append(inp[0].shape[0]))
    chunked = training.evaluate(model, x, y, "classification")
    hook.remove()
    assert passes == [7, 7, 7, 7, 2]
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)


# all clients in one forward pass; a few clients per pass, bounded by the count or by the activations' bytes
@pytest.mark.parametrize("batch, pass_bytes", [(4096, 8 << 20), (20, 8 << 20), (4096, 4 * 8 * 20)])
def test_clients_evaluated_together_equal_their_own_evaluations(monkeypatch, batch, pass_bytes):
    """evaluate_together (one model, several clients' small splits in few forward passes) gives each client
    the record of client.evaluate alone: classification and regression, a client with an empty split."""
    import torch

    from rayfl import client as client_mod
    from rayfl import training
    from rayfl.client import Client, TrainSettings, evaluate_together

    monkeypatch.setattr(client_mod, "EVAL_BATCH", batch)
    monkeypatch.setattr(training, "PASS_BYTES", pass_bytes)  # the hidden layer, 8 floats a sample, is the largest
    batch = min(batch, pass_bytes // (4 * 8))
    torch.manual_seed(1)
    for task, out_dim, y_of in (("classification", 4, lambda n: torch.randint(0, 4, (n,))),
                                ("regression", 2, lambda n: torch.randn(n, 2))):
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, out_dim))
        clients = [Client(c, {s: (torch.randn(n, 3), y_of(n)) for s, n in (("train", 2), ("val", nv), ("test", nt))},
                          lambda: model, None, TrainSettings(task, 1, 0.1, 4), seed=0)
                   for c, (nv, nt) in enumerate([(3, 5), (0, 4), (7, 2), (6, 6)])]
        client_mod.eval_pass(model, clients[0].splits["val"][0])  # its one-sample probe, before the count
        passes = []
        hook = model.register_forward_hook(lambda m, inp, out: passes.append(inp[0].shape[0]))
        together = evaluate_together(model, clients)
        hook.remove()
        assert len(together) == len(clients)
        assert passes == ([8 + 4 + 9 + 12] if batch > 33 else [8 + 4, 9, 12])  # whole clients, <= batch
        for client, rec in zip(clients, together):
            alone = client.evaluate(model)
            assert rec.keys() == alone.keys()
            for k in rec:
                np.testing.assert_allclose(rec[k], alone[k], rtol=1e-6, equal_nan=True, err_msg=k)
            assert rec["n_val"] == client.n("val")
            for split in ("val", "test"):  # and by hand, torch's own mean over the split
                x, y = client.splits[split]
                if len(x) == 0:
                    assert np.isnan(rec[f"{split}_loss"]) and np.isnan(rec[f"{split}_acc"])
                    continue
                with torch.no_grad():
                    out = model(x)
                if task == "classification":
                    assert rec[f"{split}_acc"] == pytest.approx(float((out.argmax(1) == y).double().mean()))
                    loss = torch.nn.functional.cross_entropy(out, y)
                else:
                    loss = torch.nn.functional.mse_loss(out, y)
                assert rec[f"{split}_loss"] == pytest.approx(float(loss), rel=1e-5)


def test_a_host_lays_out_a_joint_evaluation_once_and_again_when_a_split_changes():
    """The passes' inputs of a group evaluated together are gathered once and reused while its clients keep
    the same split tensors; a replaced split is laid out anew (the records follow the data, not the cache)."""
    from conftest import tiny
    from rayfl.experiment import prepare
    from rayfl.runtime import LocalRuntime

    p = prepare(tiny(algo="fedavg", clients=4, samples_per_client=30))
    host = LocalRuntime(p, n_hosts=1).hosts[0]
    glob = p.initial + np.float32(0.01)
    items = [(c, {"models": {"global": glob}}) for c in host.clients]

    def records():
        return [{k: v for k, v in up.items() if k != "seconds"} for up in host.run("evaluate", items)[0]]

    first = records()
    passes = host._layouts["passes"]
    assert records() == first and host._layouts["passes"] is passes
    client = host.clients[items[1][0]]
    xv, yv = client.splits["val"]
    client.splits["val"] = (xv[1:], yv[1:])  # one validation sample fewer
    changed = records()
    assert host._layouts["passes"] is not passes
    assert changed[1]["n_val"] == first[1]["n_val"] - 1 and changed[0] == first[0]
    alone = client.evaluate(client.model_of(glob))
    for k in alone:
        assert changed[1][k] == pytest.approx(alone[k], rel=1e-6, nan_ok=True), k


def test_a_host_evaluates_clients_sharing_the_global_model_together(monkeypatch):
    """FedAvg's clients (eval_weights: the global model) are evaluated together by their host, with the
    records their own step would give, unless their splits do not fit one pass; a logic with its own
    step_evaluate keeps it."""
    from conftest import tiny
    from rayfl import training
    from rayfl.algorithms.baselines import FedAvgClient
    from rayfl.experiment import prepare
    from rayfl.runtime import LocalRuntime

    p = prepare(tiny(algo="fedavg", clients=4, samples_per_client=30))
    host = LocalRuntime(p, n_hosts=1).hosts[0]
    glob = p.initial + np.float32(0.01)
    items = [(c, {"models": {"global": glob}}) for c in host.clients]
    assert set(host._evaluate_together(items, [{"global": glob}] * len(items))) == set(range(len(items)))
    with monkeypatch.context() as m:  # one sample a pass: no client's splits fit, each is evaluated alone
        sample = host.clients[items[0][0]].splits["val"][0][:1]
        m.setattr(training, "PASS_BYTES", 4 * training.largest_activation(host.bench.model_of(glob), sample))
        assert host._evaluate_together(items, [{"global": glob}] * len(items)) == {}
    ups, _ = host.run("evaluate", items)
    for (cid, _), up in zip(items, ups):
        alone = host.clients[cid].evaluate(host.clients[cid].model_of(glob))
        for k in alone:
            assert up[k] == pytest.approx(alone[k], rel=1e-6, nan_ok=True), k

    class OwnEvaluation(FedAvgClient):
        def step_evaluate(self, client, msg, models):
            return {"mine": 1.0}

    host.logic = OwnEvaluation(host.logic.params)
    assert host._evaluate_together(items, [{"global": glob}] * len(items)) == {}
    assert [u["mine"] for u in host.run("evaluate", items)[0]] == [1.0] * len(items)
