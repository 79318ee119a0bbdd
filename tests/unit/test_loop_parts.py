"""The loop's neighbours, each on its own: the checkpoint file (rayfl.checkpoint), user-level DP as a wrapper of
a server's average (rayfl.user_dp) and recovery from a snapshot (rayfl.recovery). The loop's use of them is
tested through runs in test_loop.py, test_pipeline.py, test_faults.py and test_privacy.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import tiny
from rayfl import checkpoint
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Loop
from rayfl.privacy import DPSettings
from rayfl.reduce import ClippedSum, WeightedMean
from rayfl.runtime import ClientsLost, LocalRuntime
from rayfl.user_dp import UserLevelDP


class Averaging:
    averages = "global_ref"

    def __init__(self):
        self.global_ref = "handle-of-the-global-model"


def test_user_level_dp_asks_the_hosts_for_a_clipped_sum_from_the_model_the_server_sent():
    dp = UserLevelDP(DPSettings(noise=1.0, clip=0.7, delta=1e-5, level="user"), seed=3, n_clients=10)
    clipped = dp.clipped(WeightedMean("weights", by="n"), Averaging())
    assert clipped == ClippedSum("weights", "handle-of-the-global-model", 0.7)
    assert dp.clipped(None, Averaging()) is None  # a call that asks for no average: left as it is
    with pytest.raises(ValueError, match=r"Averaging: dp_level=user clips and noises one average a call; a grouped "
                                         r"WeightedMean \(group='node'\)"):
        dp.clipped(WeightedMean("weights", by="n", group="node"), Averaging())


def test_user_level_average_without_noise_is_start_plus_the_sum_over_q_times_k():
    dp = UserLevelDP(DPSettings(noise=0.0, clip=1.0, delta=1e-5, level="user"), seed=0, n_clients=8)
    start = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    total = np.array([0.4, 0.2, -0.8])  # two clipped updates summed
    out = dp.average(total, start, rate=0.25, key=(0, 0))
    # θ + Σ Δ / (q K) = θ + total / 2, by hand
    np.testing.assert_allclose(out, [1.2, -1.9, 0.1], rtol=1e-6)
    assert out.dtype == np.float32


def test_user_level_noise_has_std_z_s_over_q_k_and_is_keyed_by_round_and_call():
    z, s, q, k = 1.5, 0.4, 0.5, 20
    dp = UserLevelDP(DPSettings(noise=z, clip=s, delta=1e-5, level="user"), seed=11, n_clients=k)
    start = np.zeros(200_000, dtype=np.float32)
    a = dp.average(None, start, rate=q, key=(4, 0))
    assert a.std() == pytest.approx(z * s / (q * k), rel=0.01)  # 0.06, by hand
    assert abs(a.mean()) < 5 * 0.06 / np.sqrt(start.size)
    again = UserLevelDP(dp.dp, seed=11, n_clients=k).average(None, start, rate=q, key=(4, 0))
    other = UserLevelDP(dp.dp, seed=11, n_clients=k).average(None, start, rate=q, key=(4, 1))
    np.testing.assert_array_equal(a, again)  # a replayed round draws the same noise
    assert not np.array_equal(a, other)


def test_each_user_level_average_is_one_step_of_the_accountant():
    dp = UserLevelDP(DPSettings(noise=1.2, clip=1.0, delta=1e-5, level="user"), seed=0, n_clients=4)
    assert dp.epsilon() == 0.0
    for call in range(3):
        dp.average(None, np.zeros(2, np.float32), rate=0.5, key=(0, call))
    assert dp.history == [[1.2, 0.5, 3]]
    assert dp.epsilon() > 0


def test_user_level_dp_of_a_config():
    assert UserLevelDP.of(tiny()) is None
    assert UserLevelDP.of(tiny(dp_noise=1.0, dp_level="sample")) is None
    dp = UserLevelDP.of(tiny(dp_noise=1.0, dp_level="user", dp_clip=0.3, seed=5))
    assert (dp.dp.noise, dp.dp.clip, dp.seed, dp.n_clients) == (1.0, 0.3, 5, 3)


def test_a_checkpoint_reads_back_what_was_written_and_only_for_its_config(tmp_path):
    cfg = tiny()
    assert not checkpoint.exists(str(tmp_path)) and checkpoint.read(str(tmp_path), cfg) is None
    parts = {"server": {"global": np.arange(3, dtype=np.float32)}, "clients": {}, "rng": {"a": 1},
             "server_rng": {"b": 2}, "history": [{"step": 0}], "last_eval": {}, "setup_metrics": {}}
    checkpoint.write(str(tmp_path), cfg, 4, parts)
    assert checkpoint.exists(str(tmp_path))
    state = checkpoint.read(str(tmp_path), cfg)
    assert state["step"] == 4 and state["rayfl_version"] == checkpoint.version()
    np.testing.assert_array_equal(state["server"]["global"], [0, 1, 2])
    other = dataclasses.replace(cfg, lr=0.2)
    with pytest.raises(UserError, match=r"written for another config \(lr was 0.1, now 0.2\)"):
        checkpoint.read(str(tmp_path), other)
    assert checkpoint.read(str(tmp_path), other, same_config=False)["step"] == 4
    assert checkpoint.read(str(tmp_path), dataclasses.replace(cfg, run_name="x"))["step"] == 4  # not a result


def test_a_legacy_pickle_checkpoint_is_refused_unopened(tmp_path):
    (tmp_path / checkpoint.LEGACY_FILE).write_bytes(b"not even pickle")
    assert checkpoint.exists(str(tmp_path))
    with pytest.raises(UserError, match="a pickle checkpoint of an older rayfl, not loaded"):
        checkpoint.read(str(tmp_path), tiny())


class FailsOnce(LocalRuntime):
    """In-process clients whose host 0 is replaced by a fresh one after client call ``fail_at`` (counted from 1),
    which then raises ClientsLost, as a Ray actor's restart does."""

    def __init__(self, prepared, fail_at: int):
        super().__init__(prepared)
        self.prepared, self.fail_at, self.calls = prepared, fail_at, 0

    def call(self, step, messages, reduce=None):
        self.calls += 1
        out = super().call(step, messages, reduce)
        if self.calls == self.fail_at:
            self.hosts[0] = LocalRuntime(self.prepared).hosts[0]
            raise ClientsLost(f"host 0 lost in call {self.calls}")
        return out


def test_a_replay_from_a_snapshot_rounds_back_drops_the_rounds_it_replays():
    """Snapshots after rounds 1 and 3 (snapshot_every=2). FedAvg makes two calls a round (train, evaluate):
    call 7 is round 3's training, when rounds 0-2 are in the history; the run goes back to round 1's snapshot
    and replays rounds 2 and 3, each in the history once."""
    p = prepare(tiny(rounds=4, snapshot_every=2))
    full = Loop(p, LocalRuntime(p)).run()
    loop = Loop(p, FailsOnce(p, fail_at=7)).run()
    assert loop.restarts == 1
    assert [h["step"] for h in loop.history] == [0, 1, 2, 3]
    assert [h["test_acc_mean"] for h in loop.history] == [h["test_acc_mean"] for h in full.history]
