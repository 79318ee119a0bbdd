"""FedMoE (Listo Zec et al., 2020, §3.2): the mixture's output and both losses on hand-made numbers, the frozen global model,
early stopping that returns the best epoch, stage-1 opt-out and model selection, and a small end-to-end run."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import RunInfo
from rayfl.algorithms.fedmoe import (FedMoEParams, FedMoEServer, Mixture, fit_early_stopping, make_gate,
                                     mixture_loss)
from rayfl.client import Client, TrainSettings
from rayfl.config import make_config
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop
from rayfl.reduce import reduce_uploads
from rayfl.runtime import LocalRuntime
from rayfl.training import evaluate


class Const(nn.Module):
    """Returns the same row for every input (a hand-set expert or gate)."""

    def __init__(self, row):
        super().__init__()
        self.row = nn.Parameter(torch.tensor(row, dtype=torch.float64))

    def forward(self, x):
        return self.row.expand(x.shape[0], -1)


def hand_mixture(log_space=False):
    # p_s = (0.8, 0.2), p_g = (0.3, 0.7), h = 0.25 (gate logit log(0.25 / 0.75))
    return Mixture(Const([math.log(0.8), math.log(0.2)]), Const([math.log(0.3), math.log(0.7)]),
                   Const([math.log(0.25 / 0.75)]), log_space)


def test_mixture_output_and_paper_loss():
    mix, x = hand_mixture(), torch.zeros(2, 1)
    out = mix(x)
    np.testing.assert_allclose(out.exp().detach(), [[0.425, 0.575]] * 2, rtol=1e-12)  # 0.25 p_s + 0.75 p_g
    y = torch.tensor([0, 1])
    expected = -(math.log(0.425) + math.log(0.575)) / 2
    assert float(mixture_loss(out, y).detach()) == pytest.approx(expected, rel=1e-12)
    assert float(mix.gate_value(x)[0].detach()) == pytest.approx(0.25)
    loss, acc = evaluate(mix, x, y, "classification")  # the platform's cross-entropy = NLL of P_mix
    assert loss == pytest.approx(expected, rel=1e-9) and acc == 0.5


def test_mixture_code_loss_is_gate_weighted_cross_entropy():
    out = hand_mixture(log_space=True)(torch.zeros(1, 1))
    expected = -(0.25 * math.log(0.8) + 0.75 * math.log(0.3))  # h CE_s + (1-h) CE_g for y = 0
    assert float(mixture_loss(out, torch.tensor([0])).detach()) == pytest.approx(expected, rel=1e-12)


def test_global_model_is_frozen_and_gate_has_one_output():
    client = tiny_client()
    mix = Mixture(client.new_model(), client.new_model(), make_gate(client))
    x, y = client.splits["train"]
    mixture_loss(mix(x), y).backward()
    assert all(p.grad is None for p in mix.global_model.parameters())
    assert all(p.grad is not None for p in mix.specialist.parameters())
    assert all(p.grad is not None for p in mix.gate.parameters())
    assert mix.gate(x).shape == (x.shape[0], 1)
    h = mix.gate_value(x).detach()
    assert 0 < float(h.min()) and float(h.max()) < 1


def tiny_client(val_label=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    y = (x[:, 0] > 0).long()
    xv = torch.randn(20, 4, generator=g)
    yv = (xv[:, 0] > 0).long() if val_label is None else torch.full((20,), val_label)
    splits = {"train": (x, y), "val": (xv, yv), "test": (xv, yv)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    from rayfl.training import to_vector

    settings = TrainSettings("classification", 1, 0.5, 8, "sgd")
    return Client(0, splits, lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                  to_vector(model), settings, seed=0)


def test_early_stopping_returns_best_epoch_copy():
    client = tiny_client(val_label=1)  # validation labels all 1: training on y = [x0 > 0] soon hurts them
    model = client.new_model(client.vector())
    val_before = client.loss(model)
    info = fit_early_stopping(client, model, list(model.parameters()), F.cross_entropy, 30, 3, 0.5)
    assert info["best_epoch"] < info["epochs"] < 30  # later epochs were worse, and it stopped early
    assert client.loss(model) == pytest.approx(info["best_val_loss"])  # the best epoch's weights, not the last
    assert info["best_val_loss"] <= val_before
    before = client.vector(model)  # from its own best point nothing improves: epoch 0 is returned unchanged
    info = fit_early_stopping(client, model, list(model.parameters()), F.cross_entropy, 30, 3, 0.5)
    assert info["best_epoch"] == 0 and info["epochs"] == 3
    np.testing.assert_array_equal(client.vector(model), before)


def test_params_check():
    FedMoEParams(opt_out=0.9).check(10)
    for bad, match in (({"opt_out": 1.0}, "opt_out=1.0"), ({"patience": 0}, "patience=0"),
                       ({"mixture_loss": "x"}, "mixture_loss='x'"), ({"ft_lr": -1.0}, "ft_lr=-1.0")):
        with pytest.raises(ValueError, match=match):
            FedMoEParams(**bad).check(10)


def test_stage1_opt_out_and_best_validation_selection():
    info = RunInfo(n_clients=10, rounds=4, participation=0.3, seed=0, n_train=[5] * 10)
    server = FedMoEServer(FedMoEParams(opt_out=0.5), info, lambda v: v, list, np.random.default_rng(0),
                          np.zeros(3, np.float32))
    assert len(server.opt_in) == 5 and server.per_round == 3
    val_by_round = [0.9, 0.4, 0.6, 0.5]
    called: list = []

    def call(step, msgs, reduce=None):
        called.append((step, sorted(msgs)))
        rnd = sum(1 for s, _ in called if s == "train") - 1
        if step == "train":
            return reduce_uploads(reduce, {c: {"weights": np.full(3, rnd + 1, np.float32), "n": 5, "train_loss": 0.0}
                                           for c in msgs})
        return {c: {"val_loss": val_by_round[rnd]} for c in msgs}

    stage = server.stages()[0]
    for rnd in range(4):
        server.run_round(stage, rnd, list(range(10)), call)
    assert all(set(cids) <= set(server.opt_in) and len(cids) == 3 for _, cids in called)
    np.testing.assert_array_equal(server.selected(), np.full(3, 2.0))  # round 1's model: lowest val loss
    assert server.best_round == 1 and server.selection[-1]["selected_round"] == 2  # shown from 1
    assert [s.name for s in server.stages()] == ["fedavg", "specialist", "mixture"]


class Keep(Callback):
    def __init__(self):
        self.records = {}

    def on_round(self, loop, record):
        if record.per_client:
            self.records[record.stage] = record.per_client


def test_three_stages_end_to_end_with_global_test_set():
    cfg = make_config(None, {"algo": "fedmoe", "dataset": "digits", "partition": "majority", "majority": 0.8,
                             "clients": 4, "rounds": 2, "lr": 0.05, "participation": 0.5,
                             "params": {"opt_out": 0.5, "specialist_epochs": 3, "gate_epochs": 3, "patience": 2}})
    p = prepare(cfg)
    keep = Keep()
    loop = Loop(p, LocalRuntime(p), [keep]).run()
    assert [h["stage"] for h in loop.history] == ["fedavg", "fedavg", "specialist", "mixture"]
    host = loop.runtime.hosts[0]
    gx, gy = host.clients[0].splits["global"]
    assert len(gy) == len(p.federation.holdout) and len(set(np.bincount(gy.numpy()).tolist())) == 1  # balanced
    final = keep.records["mixture"]
    for rec in final.values():
        for key in ("test_acc", "global_acc", "fedavg_test_acc", "fedavg_global_acc", "finetuned_test_acc",
                    "finetuned_global_acc"):
            assert 0.0 <= rec[key] <= 1.0
        assert 0.0 < rec["gate_mean"] < 1.0
        assert not any(k.startswith(("fedavg_val", "finetuned_val")) for k in rec)  # test and global only
    # the stage-2 record is the fine-tuned model the mixture record repeats
    for c, rec in keep.records["specialist"].items():
        assert rec["test_acc"] == pytest.approx(final[c]["finetuned_test_acc"])
    assert len(loop.server.opt_in) == 2
    assert "test_acc_worst" in loop.final
    # Table 1's columns are summary metrics of the final round (rounds.csv, MLflow, the closing table)
    for col in ("global", "fedavg_test", "fedavg_global", "finetuned_test", "finetuned_global"):
        assert loop.final[f"{col}_acc_mean"] == pytest.approx(np.mean([r[f"{col}_acc"] for r in final.values()]))
        assert loop.final[f"{col}_acc_worst"] == pytest.approx(min(r[f"{col}_acc"] for r in final.values()))
    from rayfl.progress import summary_table

    table = summary_table(loop.final)
    assert "finetuned_global_acc" in table and "fedavg_test_acc" in table


def test_stage3_specialist_starts_from_the_stage2_specialist(monkeypatch):
    """Eq. 7: the mixture's specialist continues from stage 2's fine-tuned model, not from the global model."""
    from rayfl.algorithms import fedmoe
    from rayfl.algorithms.fedmoe import FedMoEClient

    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {"train": (x[:10], y[:10]), "val": (x[10:20], y[10:20]), "test": (x[20:], y[20:])}
    make = lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 2))  # noqa: E731
    client = Client(0, splits, make, None, TrainSettings("classification", 1, 0.1, 8), 0)
    glob = np.zeros(10, np.float32)
    tuned = np.arange(10, dtype=np.float32) / 10
    client.state["finetuned"] = tuned
    monkeypatch.setattr(fedmoe, "fit_early_stopping", lambda *a, **k: {"best_epoch": 0, "epochs": 0,
                                                                        "best_val_loss": 0.0})
    FedMoEClient(FedMoEParams()).step_mixture(client, {}, {"global": glob})  # no training: the start is kept
    np.testing.assert_array_equal(client.state["specialist"], tuned)


def test_paper_defaults():
    """Listo Zec et al., 2020, §4: at most 500 epochs per stage with early stopping, no opt-out, the paper's
    mixture loss."""
    p = FedMoEParams()
    assert (p.opt_out, p.specialist_epochs, p.gate_epochs, p.mixture_loss, p.select_every) == (0.0, 500, 500,
                                                                                               "paper", 1)
    assert (p.patience, p.ft_lr) == (50, 0.0)


def test_opt_out_draws_distinct_clients():
    info = RunInfo(n_clients=100, rounds=1, participation=0.1, seed=0, n_train=[5] * 100)
    server = FedMoEServer(FedMoEParams(opt_out=0.9), info, lambda v: v, list, np.random.default_rng(0),
                          np.zeros(3, np.float32))
    assert len(server.opt_in) == 10 and server.per_round == 10


@pytest.mark.parametrize("select_every,rounds,participation,expected", [
    (2, 5, 1.0, [1, 3, 4]),
    (3, 7, 0.5, [2, 5, 6]),  # rounds 3 and 6 (counted from 1), and the last
])
def test_selection_runs_every_select_every_rounds_and_on_the_last(select_every, rounds, participation, expected):
    info = RunInfo(n_clients=4, rounds=rounds, participation=participation, seed=0, n_train=[5] * 4)
    server = FedMoEServer(FedMoEParams(select_every=select_every), info, lambda v: v, list,
                          np.random.default_rng(0), np.zeros(3, np.float32))
    assert [s.sample for s in server.stages()] == [False, False, False]  # stage 1 samples opted-in clients
    validated = []

    def call(step, msgs, reduce=None):
        if step == "validate":
            validated.append(rnd)
            return {c: {"val_loss": 1.0} for c in msgs}
        return reduce_uploads(reduce, {c: {"weights": np.zeros(3, np.float32), "n": 5, "train_loss": 0.0}
                                       for c in msgs})

    for rnd in range(rounds):
        server.run_round(server.stages()[0], rnd, list(range(4)), call)
    assert validated == expected


def test_mixture_loss_knob_picks_the_mixture_form():
    from rayfl.algorithms.fedmoe import FedMoEClient, nll

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=g)
    y = (x[:, 0] > 0).long()
    make = lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 2))  # noqa: E731
    client = Client(0, {"train": (x, y), "val": (x[:1], y[:1]), "test": (x, y)}, make, None,
                    TrainSettings("classification", 1, 0.1, 8), 0)
    vec = client.vector()
    assert not FedMoEClient(FedMoEParams()).mixture(client, vec, vec).log_space  # paper: mix probabilities
    assert FedMoEClient(FedMoEParams(mixture_loss="code")).mixture(client, vec, vec).log_space
    one = nll(client.model, x[:1], y[:1], F.cross_entropy)  # a one-sample split has a loss, not NaN
    assert one == pytest.approx(F.cross_entropy(client.model(x[:1]), y[:1]).item())


def test_nll_is_the_sample_mean_over_chunks_and_nan_when_empty():
    from rayfl.algorithms.fedmoe import nll

    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 4, generator=g)
    y = (x[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(4, 2))
    W, b = model[0].weight.detach().numpy().astype(np.float64), model[0].bias.detach().numpy().astype(np.float64)
    logits = x.numpy().astype(np.float64) @ W.T + b  # cross-entropy by hand, in numpy
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = float(-logp[np.arange(7), y.numpy()].mean())
    for batch in (1, 3, 7, 1024):  # chunks of 3: 3 + 3 + 1 samples, each weighted by its size
        assert nll(model, x, y, F.cross_entropy, batch=batch) == pytest.approx(expected, rel=1e-5)
    assert math.isnan(nll(model, x[:0], y[:0], F.cross_entropy))


def test_without_validation_the_last_epoch_is_kept_and_one_sample_is_a_validation_split():
    client = tiny_client()
    xv, yv = client.splits["val"]
    client.splits["val"] = (xv[:0], yv[:0])  # no validation data: train every epoch, keep the last
    model = client.new_model(client.vector())
    start = client.vector(model)
    info = fit_early_stopping(client, model, list(model.parameters()), F.cross_entropy, 4, 1, 0.5)
    assert (info["best_epoch"], info["epochs"]) == (4, 4) and math.isnan(info["best_val_loss"])
    assert not np.allclose(client.vector(model), start)
    client.splits["val"] = (xv[:1], yv[:1])  # one sample: early stopping on it
    model = client.new_model(client.vector())
    info = fit_early_stopping(client, model, list(model.parameters()), F.cross_entropy, 4, 10, 0.5)
    assert client.loss(model) == pytest.approx(info["best_val_loss"])


def test_stage_2_and_3_learning_rate_and_fresh_gates():
    from types import SimpleNamespace

    from rayfl.algorithms.fedmoe import FedMoEClient

    c = SimpleNamespace(settings=SimpleNamespace(lr=0.5))
    assert FedMoEClient(FedMoEParams()).lr(c) == pytest.approx(0.1)  # 0: a fifth of the run's lr (paper 1:5)
    assert FedMoEClient(FedMoEParams(ft_lr=0.03)).lr(c) == 0.03
    client = tiny_client()
    a, b = make_gate(client), make_gate(client)  # each drawn from the client's rng, which moves on
    assert not torch.equal(a[0].weight, b[0].weight)
    state = client.rng.bit_generator.state
    loaded = make_gate(client, client.vector(a))  # loading a gate draws nothing
    assert client.rng.bit_generator.state == state
    np.testing.assert_array_equal(client.vector(loaded), client.vector(a))




def test_stage_metrics_average_the_clients_and_skip_nan_and_the_opt_in_table():
    from rayfl.algorithms.base import Stage

    info = RunInfo(n_clients=4, rounds=1, participation=1.0, seed=0, n_train=[5] * 4)
    server = FedMoEServer(FedMoEParams(opt_out=0.5), info, lambda v: v, list, np.random.default_rng(0),
                          np.zeros(3, np.float32))

    def call(step, msgs):
        return {0: {"best_epoch": 2, "epochs": 5, "best_val_loss": 0.5},
                1: {"best_epoch": 4, "epochs": 7, "best_val_loss": float("nan")},
                2: {"best_epoch": 3, "epochs": 6, "best_val_loss": 0.25}}

    m = server.run_round(Stage("specialist", 1, sample=False), 0, [0, 1, 2], call)
    assert m == {"specialist_best_epoch": 3.0, "specialist_epochs": 6.0, "specialist_best_val_loss": 0.375}
    table = server.artifacts()["opt_in"]
    assert table.opt_in.tolist() == [c in server.opt_in for c in range(4)] and table.opt_in.sum() == 2


def test_early_stopping_counts_patience_from_the_last_strict_improvement(monkeypatch):
    """Validation losses scripted per check: epoch 1 improves, epoch 2 ties (not an improvement), then
    3 and 4 are worse: with patience 3 training stops after epoch 4 and keeps epoch 1."""
    from rayfl.algorithms import fedmoe

    losses = iter([1.0, 0.9, 0.9, 0.95, 0.95, 0.5, 0.5, 0.5])
    monkeypatch.setattr(fedmoe, "nll", lambda *a, **k: next(losses))
    monkeypatch.setattr(fedmoe.training, "train_epochs", lambda *a, **k: None)
    client = tiny_client()
    model = client.new_model(client.vector())
    info = fit_early_stopping(client, model, list(model.parameters()), F.cross_entropy, 8, 3, 0.5)
    assert (info["best_epoch"], info["epochs"], info["best_val_loss"]) == (1, 4, 0.9)
