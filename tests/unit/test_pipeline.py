"""The pipelined loop (a round reported while the clients run the next round's first call) computes, reports
and replays exactly what the plain loop does; a message sent to many clients travels once per host."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import same, tiny
from rayfl.batch import pack, unpack
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop, RunStopped
from rayfl.runtime import ClientsLost, LocalRuntime, Pending
from test_faults import ALGOS, FaultyRuntime, assert_same_results, client_states


def cfg_for(algo: str, **kw):
    """test_faults' small settings (every algorithm runs all its stages), any of them overridden."""
    return tiny(**{"algo": algo, "clients": 4, "rounds": 3, "clients_per_actor": 2, **ALGOS[algo], **kw})


class Reports(Callback):
    """Every round as the callbacks see it, with the clients' state when it is reported."""

    def __init__(self):
        self.rounds = []

    def on_round(self, loop, record):
        records = {c: {k: v for k, v in r.items() if k != "seconds"} for c, r in record.per_client.items()}
        self.rounds.append((record.step, dict(record.metrics), records,
                            {k: np.array(v) for k, v in record.artifacts.items()}))


class LateFaultRuntime(LocalRuntime):
    """Pipelined, and host 0 "dies" during chosen calls (counted from 1) in a way that shows only when their
    results are asked for, as under Ray: an evaluation's failure reaches the loop inside the next round's call."""

    def __init__(self, prepared, fail_at=frozenset()):
        super().__init__(prepared, pipelined=True)
        self.prepared, self.fail_at, self.calls, self.steps = prepared, fail_at, 0, []

    def submit(self, step, messages, reduce=None):
        self.calls += 1
        self.steps.append(step)
        out = self.call(step, messages, reduce)
        if self.calls not in self.fail_at:
            return Pending(lambda: out)
        self.hosts[0] = LocalRuntime(self.prepared).hosts[0]
        calls = self.calls

        def lost():
            raise ClientsLost(f"host 0 lost in call {calls} ({step})")

        return Pending(lost)


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_a_pipelined_loop_computes_and_reports_what_the_plain_one_does(algo):
    """Same metrics, same records, same server artifacts (as each round left them), same clients at the end."""
    p = prepare(cfg_for(algo))
    plain, piped = Reports(), Reports()
    a = Loop(p, LocalRuntime(p), [plain]).run()
    b = Loop(p, LocalRuntime(p, pipelined=True), [piped]).run()
    assert_same_results(b.history, a.history)
    assert [r[0] for r in piped.rounds] == [r[0] for r in plain.rounds] == list(range(len(a.history)))
    for (_, _, recs_a, arts_a), (_, _, recs_b, arts_b) in zip(plain.rounds, piped.rounds):
        assert same(recs_a, recs_b)
        assert same(arts_a, arts_b)
    assert same(client_states(a), client_states(b))


def test_a_round_is_reported_while_the_next_one_trains():
    """Under a pipelined runtime round t reaches the callbacks inside round t+1's first client call; the last
    round, before the loop ends."""
    p = prepare(cfg_for("fedavg", rounds=3))
    seen = []

    class Order(Callback):
        def on_round(self, loop, record):
            seen.append(("report", record.step))

    class Recording(LocalRuntime):
        def submit(self, step, messages, reduce=None):
            seen.append(("submit", step))
            pending = super().submit(step, messages, reduce)
            return Pending(lambda: seen.append(("result", step)) or pending.result())

    Loop(p, Recording(p, pipelined=True), [Order()]).run()
    rounds = [[("submit", "train"), ("report", t - 1), ("result", "train"), ("submit", "evaluate")]
              for t in range(3)]
    want = [e for r in rounds for e in r if e != ("report", -1)] + [("result", "evaluate"), ("report", 2)]
    for t in (0, 1):  # round t's evaluation is waited for inside round t+1's training call
        i = want.index(("report", t))
        want.insert(i, ("result", "evaluate"))
    assert seen == want


@pytest.mark.parametrize("algo", ["fedavg", "fedfomo", "local"])
@pytest.mark.parametrize("late", [True, False])
def test_a_round_cut_short_by_a_fault_is_replayed_from_the_round_before(algo, late):
    """A client actor dies during an evaluation, and its failure shows in the next round's call (``late``, as
    under Ray) or at once: the unreported round is replayed from the last snapshot, never reported from
    before the fault, and the run ends as if nothing happened."""
    p = prepare(cfg_for(algo))
    full = LateFaultRuntime(p)
    want = Loop(p, full).run()
    evals = [i + 1 for i, step in enumerate(full.steps) if step == "evaluate"]
    fail_at = {evals[0], evals[-2]}
    if late:
        runtime = LateFaultRuntime(p, fail_at)
    else:  # the next call fails as it is submitted
        runtime = FaultyRuntime(p, fail_at={i + 1 for i in fail_at})
        runtime.pipelined = True
    loop = Loop(p, runtime).run()
    assert loop.restarts == 2
    assert_same_results(loop.history, want.history)
    assert same(client_states(loop), client_states(want))
    assert [h["step"] for h in loop.history] == list(range(len(want.history)))


def test_a_failing_run_still_reports_the_round_that_was_waiting():
    """The server fails in round 2 before any client call: round 1, evaluated and not yet reported, is reported
    before the error ends the run (nothing it logged is lost)."""
    p = prepare(cfg_for("fedavg", rounds=4))
    seen = Reports()
    loop = Loop(p, LocalRuntime(p, pipelined=True), [seen])
    run_round = loop.server.run_round

    def failing(stage, step, participants, call):
        if step == 2:
            raise RuntimeError("the server failed")
        return run_round(stage, step, participants, call)

    loop.server.run_round = failing
    with pytest.raises(RuntimeError, match="the server failed"):
        loop.run()
    assert [r[0] for r in seen.rounds] == [0, 1] and "test_acc_mean" in seen.rounds[1][1]


def test_a_round_without_client_calls_reports_the_one_before_itself():
    p = prepare(cfg_for("fedavg", rounds=4))
    seen = Reports()
    loop = Loop(p, LocalRuntime(p, pipelined=True), [seen])
    run_round = loop.server.run_round
    loop.server.run_round = lambda stage, step, *a: {} if step == 2 else run_round(stage, step, *a)
    loop.run()
    assert [r[0] for r in seen.rounds] == [0, 1, 2, 3] == [h["step"] for h in loop.history]
    assert all("test_acc_mean" in r[1] for r in seen.rounds)


def test_a_stop_asked_for_ends_the_run_after_the_rounds_under_way_are_reported():
    p = prepare(cfg_for("fedavg", rounds=5))
    seen = Reports()

    class Stop(Callback):
        def on_round(self, loop, record):
            loop.stop_requested = record.step == 1

    loop = Loop(p, LocalRuntime(p, pipelined=True), [seen, Stop()])
    with pytest.raises(RunStopped):
        loop.run()
    assert [r[0] for r in seen.rounds] == [0, 1, 2] == [h["step"] for h in loop.history]


def test_a_checkpoint_reads_the_clients_as_its_round_left_them(tmp_path):
    """A checkpoint round is reported at once, before the next round's call: resuming from it gives the
    uninterrupted result."""
    p = prepare(cfg_for("fedfomo", rounds=4, checkpoint_every=2))
    want = Loop(p, LocalRuntime(p)).run()
    first = Loop(p, LocalRuntime(p, pipelined=True), checkpoint_dir=str(tmp_path))
    run_round = first.server.run_round

    def stop_at_3(stage, step, participants, call):
        if step == 3:
            raise KeyboardInterrupt
        return run_round(stage, step, participants, call)

    first.server.run_round = stop_at_3
    with pytest.raises(KeyboardInterrupt):
        first.run()
    resumed = Loop(p, LocalRuntime(p, pipelined=True), checkpoint_dir=str(tmp_path)).run()
    assert resumed.start_step == 2
    assert_same_results(resumed.history, want.history)
    assert same(client_states(resumed), client_states(want))


def test_pack_sends_each_distinct_message_once_and_unpacks_to_the_same_batch():
    shared, own = {"models": {"global": "g"}}, {"models": {"global": "x"}}
    items = [(3, shared), (5, own), (7, shared), (9, shared)]
    cids, messages, which = pack(items)
    assert cids == [3, 5, 7, 9] and messages == [shared, own] and which == [0, 1, 0, 0]
    back = unpack((cids, [dict(m) for m in messages], which))  # as deserialized: new objects
    assert [c for c, _ in back] == cids and back[0][1] is back[2][1] is back[3][1] and back[1][1] == own


def test_a_host_resolves_a_message_sent_to_many_clients_once():
    p = prepare(cfg_for("fedavg"))
    asked = []
    rt = LocalRuntime(p, n_hosts=1)
    host = rt.hosts[0]
    host.resolve = lambda handles: asked.append(len(handles)) or list(handles)
    msg = {"models": {"global": np.asarray(p.initial)}}
    host.run("evaluate", [(c, msg) for c in sorted(host.clients)])
    assert asked == [1]
