"""The engine in one process: reductions, placement-independence of results, the background MLflow writer."""

from __future__ import annotations

import math
import numpy as np
import torch
import pytest
from mlflow.tracking import MlflowClient

from conftest import tiny
from test_faults import ALGOS  # small settings under which every algorithm runs all of its stages
from rayfl.algorithms.base import RunInfo
from rayfl.algorithms.baselines import FedAvgServer
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.reduce import WeightedMean, accumulate, combine, reduce_uploads
from rayfl.runtime import LocalRuntime
from rayfl.tracking import MlflowTracker, ensure_experiment


def test_weighted_mean_of_unequal_clients_by_hand():
    v = {0: np.array([1.0, 0.0], np.float32), 1: np.array([4.0, 2.0], np.float32), 2: np.array([0.0, 8.0], np.float32)}
    n = {0: 10, 1: 30, 2: 60}
    expected = np.array([(10 * 1 + 30 * 4 + 0) / 100, (0 + 30 * 2 + 60 * 8) / 100])  # [1.3, 5.4]
    ups = reduce_uploads(WeightedMean("weights", by="n"), {c: {"weights": v[c], "n": n[c], "loss": 0.1} for c in v})
    np.testing.assert_allclose(ups.reduced["weights"], [1.3, 5.4], rtol=1e-6)
    np.testing.assert_allclose(ups.reduced["weights"], expected, rtol=1e-6)
    assert all("weights" not in u and u["loss"] == 0.1 for u in ups.values())  # the rest arrives as usual
    # two hosts' partial sums combine to the same mean
    parts = [{}, {}]
    for c, host in ((0, 0), (1, 1), (2, 1)):
        accumulate(WeightedMean(), {"weights": v[c], "n": n[c]}, parts[host])
    np.testing.assert_allclose(combine(WeightedMean(), parts)["weights"], expected, rtol=1e-6)
    frozen = {c: v[c].copy() for c in v}  # read-only, as an object-store array is
    for arr in frozen.values():
        arr.flags.writeable = False
    ups = reduce_uploads(WeightedMean(), {c: {"weights": frozen[c], "n": n[c]} for c in v})
    np.testing.assert_allclose(ups.reduced["weights"], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="positive"):
        combine(WeightedMean(), [{}])


def test_grouped_weighted_mean_by_hand():
    v = {0: np.array([1.0, 0.0], np.float32), 1: np.array([4.0, 2.0], np.float32), 2: np.array([0.0, 8.0], np.float32),
         3: np.array([2.0, 2.0], np.float32), 4: np.array([9.0, 9.0], np.float32)}
    n = {0: 10, 1: 30, 2: 60, 3: 5, 4: 0}
    group = {0: "a", 1: "b", 2: "a", 3: "b", 4: "c"}  # the message field names each client's group
    msgs = {c: {"models": {}, "cluster": group[c]} for c in v}
    reduce = WeightedMean("weights", by="n", group="cluster")
    # a: (10·(1, 0) + 60·(0, 8)) / 70; b: (30·(4, 2) + 5·(2, 2)) / 35; c has no weight: no mean
    expected = {"a": [10 / 70, 480 / 70], "b": [130 / 35, 70 / 35]}
    ups = reduce_uploads(reduce, {c: {"weights": v[c], "n": n[c]} for c in v}, msgs)
    assert sorted(ups.reduced["weights"]) == ["a", "b"]
    for g, mean in expected.items():
        np.testing.assert_allclose(ups.reduced["weights"][g], mean, rtol=1e-6)
    parts = [{}, {}]  # two hosts, each holding members of both groups
    for c, host in ((0, 0), (1, 0), (2, 1), (3, 1), (4, 1)):
        accumulate(reduce, {"weights": v[c], "n": n[c]}, parts[host], msgs[c])
    both = combine(reduce, parts)["weights"]
    for g, mean in expected.items():
        np.testing.assert_allclose(both[g], mean, rtol=1e-6)
    assert combine(reduce, [{}]) == {"weights": {}}  # no upload with weight: no group, and no error


def test_fedavg_server_takes_the_size_weighted_mean():
    info = RunInfo(n_clients=2, rounds=1, participation=1.0, seed=0, n_train=[1, 3])
    server = FedAvgServer(None, info, lambda x: x, lambda hs: list(hs), np.random.default_rng(0), np.zeros(2, np.float32))
    trained = {0: np.array([2.0, 2.0], np.float32), 1: np.array([6.0, -2.0], np.float32)}

    def call(step, msgs, reduce=None):
        return reduce_uploads(reduce, {c: {"weights": trained[c], "n": info.n_train[c], "train_loss": 0.0} for c in msgs})

    server.run_round(server.stages()[0], 0, [0, 1], call)
    np.testing.assert_allclose(server.final_model(), [(2 + 18) / 4, (2 - 6) / 4])  # [5, -1], not the plain mean [4, 0]


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_results_do_not_depend_on_placement(algo):
    """One host for all clients, one per client, and an uneven split give the same metrics to float tolerance
    (every algorithm, in test_faults' small settings that run all of its stages)."""
    cfg = tiny(algo=algo, clients=4, rounds=3, samples_per_client=40, sizes="lognormal", **ALGOS[algo])
    histories = []
    for hosts in (1, 4, 3):
        p = prepare(cfg)
        histories.append(Loop(p, LocalRuntime(p, n_hosts=hosts)).run().history)
    for other in histories[1:]:
        assert len(other) == len(histories[0])
        for a, b in zip(histories[0], other):
            keys = [k for k in a if k.startswith(("test_", "val_", "train_loss"))]
            assert keys and set(keys) <= set(b)
            for k in keys:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


class Boom(Exception):
    pass


def test_background_writer_keeps_every_value_when_the_run_fails(tmp_path):
    """Rounds 1-2 logged through the background writer all reach the store although round 3 fails."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = tiny(algo="fedavg", clients=4, rounds=5, client_metrics=100)
    p = prepare(cfg)
    tracker = MlflowTracker(uri, ensure_experiment(uri, "t"), run_name="fails")
    loop = Loop(p, LocalRuntime(p), [tracker])
    original = loop.server.run_round

    def run_round(stage, rnd, participants, call):
        if rnd == 2:
            raise Boom()
        return original(stage, rnd, participants, call)

    loop.server.run_round = run_round
    with pytest.raises(Boom):
        try:
            loop.run()
        except Boom:
            tracker.fail()
            raise
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")] == [1, 2]  # rounds
    assert len(client.get_metric_history(run.info.run_id, "client/3/test_acc")) == 2
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "results/clients")}
    assert tables == {"results/clients/round_0001.csv", "results/clients/round_0002.csv"}
    import pandas as pd

    table = pd.read_csv(client.download_artifacts(run.info.run_id, "results/clients/round_0002.csv"))
    assert list(table.client) == [0, 1, 2, 3] and (table["round"] == 2).all()
    assert table.test_acc.mean() == pytest.approx(loop.history[1]["test_acc_mean"])


def test_a_round_table_reads_back_as_pandas_writes_it(tmp_path):
    """The per-round client table (csv module, for speed) reads back as pandas' to_csv of the same records
    does: a column per key in first-seen order, NaN and missing keys empty, numpy scalars as numbers."""
    import pandas as pd

    from rayfl.tracking import write_client_table

    records = {2: {"val_loss": 0.25, "val_acc": float("nan"), "n_val": 3, "test_loss": np.float32(1.5)},
               0: {"val_loss": 1 / 3, "val_acc": 0.5, "n_val": np.int64(4), "test_loss": np.float32("nan")},
               1: {"val_loss": 2.0, "extra": True}}
    write_client_table(str(tmp_path / "mine.csv"), 5, records)
    theirs = pd.DataFrame([{"client": c, **rec} for c, rec in sorted(records.items())])
    theirs.insert(0, "round", 5)
    theirs.to_csv(tmp_path / "pandas.csv", index=False)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "mine.csv"), pd.read_csv(tmp_path / "pandas.csv"),
                                  check_exact=True)
    assert ",," in (tmp_path / "mine.csv").read_text() and "nan" not in (tmp_path / "mine.csv").read_text()


def test_a_numbers_only_table_is_written_by_arrow_and_reads_back_exactly(tmp_path):
    """Numbers only (the usual table): Arrow's writer, which must read back as pandas' to_csv does, to the
    bit: float32 as numpy writes it, integral floats as floats (1.0, not 1), tiny and huge magnitudes, NaN
    and missing keys empty, an integer column with gaps, a column with no value at all."""
    import pandas as pd

    from rayfl.tracking import tables as tracking

    rng = np.random.default_rng(0)
    records, ids = {}, rng.choice(10**6, size=300, replace=False)
    for c in range(300):
        rec = {"loss": float(rng.lognormal(0, 3)), "acc": int(rng.integers(0, 5)) / 4, "hit": float(rng.integers(0, 2)),
               "tiny": float(rng.uniform(-1, 1) * 10.0 ** rng.integers(-12, -3)), "f32": np.float32(rng.normal() if c % 3 else c % 2),
               "n_test": np.int64(rng.integers(1, 9)), "huge": float(rng.normal() * 1e21), "gone": None}
        if c % 7 == 0:
            rec.update(loss=float("nan"), n_train=int(rng.integers(1, 50)))
        records[int(ids[c])] = rec
    assert tracking._numbers_table([[0.5, 1.0, None], [np.int64(3), None, 1]]) is not None  # the Arrow path
    tracking.write_client_table(str(tmp_path / "mine.csv"), 7, records)
    theirs = pd.DataFrame([{"client": c, **rec} for c, rec in sorted(records.items())])
    theirs.insert(0, "round", 7)
    theirs.to_csv(tmp_path / "pandas.csv", index=False)
    mine = pd.read_csv(tmp_path / "mine.csv")
    pd.testing.assert_frame_equal(mine, pd.read_csv(tmp_path / "pandas.csv"),
                                  check_exact=True)
    loss = [records[c]["loss"] for c in sorted(records)]
    assert list(mine.loss.fillna(-1)) == [-1 if math.isnan(v) else v for v in loss]  # the values themselves
    assert mine.hit.dtype == np.float64 and mine.n_train.isna().sum() == sum(c % 7 != 0 for c in range(300))
    text = (tmp_path / "mine.csv").read_bytes().decode()  # as written: no newline translation
    assert text.startswith("round,client,loss,acc,hit,tiny,f32,n_test,huge,gone,n_train\n") and "\r" not in text


def test_per_client_metrics_only_for_small_federations(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = prepare(tiny(algo="fedavg", clients=4, rounds=1, client_metrics=3))
    tracker = MlflowTracker(uri, ensure_experiment(uri, "t"))
    Loop(p, LocalRuntime(p), [tracker]).run()
    metrics = MlflowClient(uri).get_run(tracker.run_id).data.metrics
    assert "test_acc_mean" in metrics and not any(k.startswith("client/") for k in metrics)


def test_quick_rounds_share_store_calls_and_every_value_arrives(tmp_path, monkeypatch):
    """Rounds shorter than METRICS_EVERY are sent in shared batches, their client tables too (fewer store
    calls than rounds), yet every round's value and table reaches the store, at its round; a lone round is
    sent within METRICS_EVERY even if no other round follows."""
    import time

    from rayfl.tracking import callback as tracking
    from rayfl.tracking.outbox import Outbox, Sender

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    calls, table_calls = [], []
    original = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", lambda self, *a, **k: (calls.append(1), original(self, *a, **k))[1])
    for name in ("log_artifact", "log_artifacts"):
        def counted(self, run_id, local, *a, _original=getattr(MlflowClient, name), **k):
            if "round_" in local or "mlflow_outbox" in local:  # a batch's tree of files
                table_calls.append(local)
            return _original(self, run_id, local, *a, **k)
        monkeypatch.setattr(MlflowClient, name, counted)
    p = prepare(tiny(algo="fedavg", clients=3, rounds=12, client_metrics=100))
    tracker = MlflowTracker(uri, ensure_experiment(uri, "t"))
    Loop(p, LocalRuntime(p), [tracker]).run()
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "test_acc_mean")] == list(range(1, 13))
    assert len(client.get_metric_history(tracker.run_id, "client/2/test_acc")) == 12
    assert len(calls) < 12
    tables = sorted(a.path for a in client.list_artifacts(tracker.run_id, "results/clients"))
    assert tables == [f"results/clients/round_{r:04d}.csv" for r in range(1, 13)] and 0 < len(table_calls) < 12

    # the idle writer sends what waits: a metric queued alone is in the store within METRICS_EVERY (+ margin)
    monkeypatch.setattr(tracking, "METRICS_EVERY", 0.2)
    t = MlflowTracker(uri, ensure_experiment(uri, "t"))
    t._client, t.run_id = client, client.create_run(ensure_experiment(uri, "t")).info.run_id
    t.writer = tracking.Writer(idle=t._send_metrics, every=0.2)
    t.outbox = Outbox(str(tmp_path / "outbox"))
    t.sender = Sender(client, t.run_id, uri, t.outbox)
    t._sent = time.monotonic()  # as if a batch had just gone: this value must wait for the idle send
    t._submit(lambda: t._log_metrics({"x": 1.0}, 1))
    deadline = time.monotonic() + 5
    while not client.get_metric_history(t.run_id, "x") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m.value for m in client.get_metric_history(t.run_id, "x")] == [1.0]
    t._sent = time.monotonic()  # and a round file staged alone
    t._submit(lambda: t._log_file("round_0001.csv", lambda path: open(path, "w").write("round\n1\n"),
                                  "results/clients"))
    deadline = time.monotonic() + 5
    while not client.list_artifacts(t.run_id, "results/clients") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [a.path for a in client.list_artifacts(t.run_id, "results/clients")] == ["results/clients/round_0001.csv"]
    t.writer.close()


def test_snapshots_encode_again_only_the_clients_that_ran_a_step(monkeypatch):
    """A host's state() re-encodes only clients that ran a non-evaluation step since the last call; the blobs
    it returns are what encoding every client afresh gives."""
    from rayfl import host as host_module

    p = prepare(tiny(algo="local", clients=4, rounds=1))
    runtime = LocalRuntime(p)
    h = runtime.hosts[0]
    encoded = []
    original = host_module.dumps
    monkeypatch.setattr(host_module, "dumps", lambda obj: (encoded.append(1), original(obj))[1])
    first = h.state()
    assert len(encoded) == 4
    h.run("evaluate", [(c, {}) for c in range(4)])
    assert h.state() == first and len(encoded) == 4  # evaluation changed nothing: nothing encoded again
    h.run("train", [(1, {}), (3, {})])
    second = h.state()
    assert len(encoded) == 6  # clients 1 and 3 only
    assert second[0] == first[0] and second[2] == first[2] and second[1] != first[1] and second[3] != first[3]
    encoded.clear()
    h._encoded.clear()  # encoding every client afresh gives the same states (a client evaluated with no
    fresh = h.state()   # weights of its own may now hold a copy of the initial model: the same model)
    assert len(encoded) == 4
    from rayfl.snapshot import loads

    for c in range(4):
        a, b = loads(second[c]), loads(fresh[c])
        for st in (a, b):
            st["model"] = p.initial if st["model"] is None else st["model"]
        np.testing.assert_array_equal(a["model"], b["model"])
        assert a["state"] == b["state"] and a["rng"] == b["rng"]
        assert torch.equal(a["gen"], b["gen"])


def test_the_store_opens_in_the_background_and_the_run_exists_before_round_one(tmp_path, monkeypatch):
    """``open`` returns at once while the writer opens the store and creates the experiment (by name): a driver
    calls it while its client actors start. The run exists before the first round and gets every value."""
    import threading

    from rayfl.loop import Callback
    from rayfl.tracking import MlflowTracker as Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    release, connected = threading.Event(), threading.Event()
    connect = Tracker._connect
    monkeypatch.setattr(Tracker, "_connect", lambda self: (release.wait(30), connect(self), connected.set()))
    tracker = MlflowTracker(uri, experiment="by-name", run_name="bg")
    tracker.open()  # must not wait for the store
    assert not connected.is_set()
    release.set()
    runs_at_round = []

    class Runs(Callback):
        def on_round(self, loop, record):
            runs_at_round.append(len(MlflowClient(uri).search_runs([tracker.experiment_id])))

    p = prepare(tiny(algo="fedavg", clients=3, rounds=3))
    Loop(p, LocalRuntime(p), [Runs(), tracker]).run()
    assert runs_at_round == [1, 1, 1] and tracker.writer is None  # closed by on_end
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "by-name"
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "bg"
    assert run.data.params["algo"] == "fedavg" and run.data.tags["rayfl.algo"] == "fedavg"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "test_acc_mean")] == [1, 2, 3]


def test_a_store_that_cannot_be_opened_ends_the_run_before_its_first_round(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient as Client

    from rayfl.config import UserError

    def refuse(self, name):
        raise ConnectionError("connection refused\nsecond line")

    monkeypatch.setattr(Client, "get_experiment_by_name", refuse)
    p = prepare(tiny(algo="fedavg", clients=3, rounds=5))
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", experiment="e")
    loop = Loop(p, LocalRuntime(p), [tracker])
    with pytest.raises(UserError, match=r"^tracking_uri='sqlite:///.*': cannot open experiment 'e' there "
                                        r"\(ConnectionError: connection refused\)$"):
        try:
            loop.run()
        except UserError:
            tracker.fail()  # as execute() does: nothing more to raise, no run to close
            raise
    assert loop.history == []


def test_a_store_that_fails_later_ends_the_run_at_the_next_round(tmp_path, monkeypatch):
    """After the run started, a failing store stops the run at the end of the next round, not its last."""
    import threading

    from rayfl.loop import Callback

    failed = threading.Event()

    def broken(*args, **kwargs):
        failed.set()
        raise ConnectionError("the store went away")

    class AfterTheFailure(Callback):  # round 1's values are the first the writer sends; wait for its failure
        def on_round(self, loop, record):
            if record.step == 1:
                failed.wait(30)

    p = prepare(tiny(algo="fedavg", clients=3, rounds=6))
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", experiment="e")
    loop = Loop(p, LocalRuntime(p), [AfterTheFailure(), tracker])
    original = tracker._log_metrics
    monkeypatch.setattr(tracker, "_log_metrics", lambda m, step: broken() if step >= 1 else original(m, step))
    with pytest.raises(ConnectionError, match="the store went away"):
        try:
            loop.run()
        except ConnectionError:
            tracker.fail()
            raise
    assert len(loop.history) == 2
    assert MlflowClient(tracker.uri).get_run(tracker.run_id).info.status == "FAILED"


def test_the_writer_yields_the_cpu_once_the_store_is_open(tmp_path):
    """Tracking takes the CPU that the rounds leave: once connected, the writer thread is WRITER_NICER nicer
    than the thread that made it (Linux sets niceness per thread)."""
    import os
    import threading

    from rayfl.tracking import writer as tracking

    seen = []
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", experiment="e")
    tracker.open()
    tracker._submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    tracker.writer.flush()
    tracker.writer.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, mine + tracking.WRITER_NICER)] and tracking.WRITER_NICER > 0


def test_the_writer_counts_the_cpu_of_its_jobs_not_their_waits():
    """``Writer.cpu_seconds`` (logged as tracking_cpu_seconds) is CPU time: a job that computes for 0.2 s of
    CPU counts, one that sleeps 0.3 s does not."""
    import time

    from rayfl.tracking import Writer

    def compute():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass

    writer = Writer()
    writer.submit(compute)
    writer.submit(lambda: time.sleep(0.3))
    writer.flush()
    writer.close()
    assert 0.2 <= writer.cpu_seconds < 0.28


def test_each_round_logs_what_tracking_cost_it(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = prepare(tiny(algo="fedavg", clients=4, rounds=3))
    tracker = MlflowTracker(uri, experiment="t")
    Loop(p, LocalRuntime(p), [tracker]).run()
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "tracking_cpu_seconds")
    assert sorted(m.step for m in history) == [1, 2, 3]
    values = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert values[0] >= 0 and all(v > 0 for v in values[1:])  # rounds 2, 3: the previous round's table
    assert sum(values) < 2.0  # the store's opening (seconds of imports) is not charged to the rounds


def test_the_run_tags_what_tracking_cost_its_rounds_last_batch_included(tmp_path, monkeypatch):
    """Metrics wait for a batch (here: all of them, for the end), so no round's own tracking_cpu_seconds can
    hold that batch; the tag rayfl.tracking_cpu_seconds does. Sending a batch is made to cost 0.2 s of CPU."""
    import time

    from rayfl.tracking import callback as tracking

    monkeypatch.setattr(tracking, "METRICS_EVERY", 1e9)  # every metric goes in the last batch
    sends = []
    real = MlflowTracker._log_items

    def costly(self, items):
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        sends.append(len(items))
        real(self, items)

    monkeypatch.setattr(MlflowTracker, "_log_items", costly)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    p = prepare(tiny(algo="fedavg", clients=4, rounds=3))
    tracker = MlflowTracker(uri, experiment="t")
    Loop(p, LocalRuntime(p), [tracker]).run()
    client = MlflowClient(uri)
    rounds = sum(m.value for m in client.get_metric_history(tracker.run_id, "tracking_cpu_seconds"))
    total = float(client.get_run(tracker.run_id).data.tags["rayfl.tracking_cpu_seconds"])
    assert sends and rounds < 0.2 <= total - rounds < 0.2 * len(sends) + 0.1


DRIVER_SIDE = r"""
import pickle, sys
from rayfl.actors.driver import DriverActor
from rayfl.actors.runtime import RayRuntime
from rayfl.inprocess import execute
from rayfl.loop import Loop
from rayfl.tracking import MlflowTracker
p = pickle.loads(sys.stdin.buffer.read())
p.algorithm.Server(p.algorithm.make_params(p.cfg.params), p.info, lambda v: v, list, None, p.initial)
p.cfg.to_flat()  # the tracker's params
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("algo,needs_torch", [("fedavg", False), ("fedfomo", False), ("federico", True)])
def test_a_driver_imports_torch_only_for_an_algorithm_whose_module_needs_it(algo, needs_torch):
    """What a driver process reads and runs (the prepared experiment, the loop, the server, the tracker's
    params) imports no torch for FedAvg: the import took about 2 s of its start-up, before its MLflow work."""
    import pickle
    import subprocess
    import sys

    blob = pickle.dumps(prepare(tiny(algo=algo, clients=6)))
    out = subprocess.run([sys.executable, "-c", DRIVER_SIDE], input=blob, capture_output=True, check=True)
    imported = out.stdout.decode().strip()
    assert (imported != "[]") == needs_torch, imported
