"""The one round loop every algorithm runs in.

It owns what no algorithm should write again: participant sampling, dispatch with timing, evaluation
of every client's personalized model on its own test split, the summary across clients, callbacks
(MLflow, Tune, progress), checkpoints and resuming. The final round is what is reported, never the
best round on test. Under Ray a round is reported while the clients run the next round's first call
(:meth:`Loop.finish_round`): the driver's summary and logging no longer sit between two rounds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfl import privacy, snapshot
from rayfl.algorithms.base import capability
from rayfl.config import NOT_RESULTS, UserError
from rayfl.divergence import Diverged, model_has_nan, round_problem, step_size_hint
from rayfl.metrics import round_summary
from rayfl.reduce import ClippedSum, WeightedMean
from rayfl.runtime import ClientsLost
from rayfl.stage_cache import StageReuse


class RunStopped(Exception):
    """The submitter asked the run to stop (Ctrl-C, a Tune scheduler): it ends between two rounds."""


class NoCapacity(RuntimeError):
    """Client actors were lost (their node left the cluster) and no room for them came up within
    ``capacity_wait`` seconds: the run ends, its newest snapshot written as its checkpoint (``checkpoint``:
    that file's directory and round, or None when there was none to write)."""

    checkpoint: tuple[str, int] | None = None


class Callback:
    """Hooks the loop calls; tracking, Tune reporting and progress display are callbacks."""

    def on_start(self, loop: "Loop") -> None: ...
    def on_setup(self, loop: "Loop") -> None: ...
    def on_round(self, loop: "Loop", record: "RoundRecord") -> None: ...
    def on_end(self, loop: "Loop") -> None: ...
    def on_recover(self, loop: "Loop", event: dict) -> None: ...  # client actors died; rounds are replayed
    def on_checkpoint(self, loop: "Loop") -> None: ...  # before a checkpoint: make what was reported durable


@dataclass
class RoundRecord:
    step: int  # global round counter across stages (the MLflow step)
    stage: str
    participants: list[int]
    metrics: dict[str, float]  # the algorithm's own, the summary across clients, timings
    per_client: dict[int, dict] = field(default_factory=dict)  # evaluation records, when evaluated
    artifacts: dict[str, Any] = field(default_factory=dict)  # the server's round_artifacts, as the round left them
    epsilon: float | None = None  # user-level DP: the run's ε after this round (every user's)
    warnings: list[str] = field(default_factory=list)  # the server's caveats found this round (Server.warnings)


def round_event(loop: "Loop", record: RoundRecord) -> dict:
    """What a submitter sees of a round (progress, Tune reports): plain data, the same from every runtime."""
    return {"step": record.step, "stage": record.stage, "metrics": record.metrics,
            "participants": len(record.participants), "total": len(loop.schedule()), "warnings": record.warnings}


class Loop:
    def __init__(self, prepared, runtime, callbacks=(), checkpoint_dir: str | None = None):
        self.prepared = prepared
        self.cfg = prepared.cfg
        self.runtime = runtime
        self.callbacks = list(callbacks)
        self.checkpoint_dir = checkpoint_dir
        self.rng = np.random.default_rng([self.cfg.seed, 1])  # participant sampling
        algo = prepared.algorithm
        self.server = algo.Server(prepared.params, prepared.info, runtime.put, runtime.get,
                                  np.random.default_rng([self.cfg.seed, 2]), prepared.initial)
        self.history: list[dict] = []
        self.last_eval: dict[int, dict] = {}
        self.setup_metrics: dict = {}
        self.start_step = 0
        self.call_seconds = self.reporting_seconds = 0.0
        self.unfinished: tuple | None = None  # (record, evaluation, when asked, snapshot) of a round not yet reported
        self.stop_requested = False
        self.setup_done = self.setup_reported = False
        self.reported = -1  # the last round the callbacks have seen (replayed rounds are not shown twice)
        self.restarts = 0  # client-actor faults survived
        self.snapshots: list[dict] = []  # the last two in-memory snapshots, newest last
        self.stage_reuse = None
        dp = privacy.DPSettings.from_config(self.cfg)
        self.user_dp = dp if dp is not None and dp.level == "user" else None
        self.dp_history: list = []  # user-level DP: the run's accountant history, one step per averaging round
        self.stage, self.step, self.private_calls = None, -1, 0

    # --- pieces ---------------------------------------------------------------------------------
    def call(self, step: str, messages: dict[int, dict], reduce=None) -> dict[int, dict]:
        """A server's client call. While the clients work on it, the round before is reported (see
        :meth:`finish_round`); that time is the previous round's, not this call's."""
        t0 = time.perf_counter()
        private = self.user_dp is not None and isinstance(reduce, WeightedMean)
        if private and reduce.group is not None:
            raise ValueError(f"{type(self.server).__name__}: dp_level=user clips and noises one average a call; "
                             f"a grouped WeightedMean (group={reduce.group!r}) makes one per group")
        if private:  # user-level DP: each host sums its clients' clipped updates instead
            start = getattr(self.server, capability(self.server, "averages"))
            reduce = ClippedSum(reduce.key, start, self.user_dp.clip)
        pending = self.runtime.submit(step, messages, reduce)
        t1 = time.perf_counter()
        self.finish_round()
        t2 = time.perf_counter()
        out = pending.result()
        if private:
            out.reduced[reduce.key] = self.private_average(out.reduced[reduce.key], start)
        self.call_seconds += time.perf_counter() - t0 - (t2 - t1)
        self.reporting_seconds += t2 - t1
        return out

    def private_average(self, total, start) -> np.ndarray:
        """The round's model from the hosts' clipped sum: noised once, over the fixed denominator q·K, the step
        counted by the run's accountant (user-level DP). Its noise depends on the seed, round and call only, so a
        replayed round draws the same."""
        rate = self.cfg.participation if self.stage is not None and self.stage.sample else 1.0
        rng = np.random.default_rng([self.cfg.seed, 0xD9, self.step, self.private_calls])
        self.private_calls += 1
        privacy.spend(self.dp_history, self.user_dp.noise, rate, 1, self.user_dp.accountant)
        return privacy.user_level_average(total, self.runtime.get([start])[0], self.user_dp, rate, self.cfg.clients,
                                          rng)

    def sample(self, stage) -> list[int]:
        n = self.cfg.clients
        if not stage.sample or self.cfg.participation >= 1:
            return list(range(n))
        if self.user_dp is not None:  # Poisson sampling of users: what the accountant assumes (DP-FedAvg, Alg. 1)
            return [int(c) for c in np.flatnonzero(self.rng.random(n) < self.cfg.participation)]
        k = max(1, int(round(self.cfg.participation * n)))
        return sorted(int(c) for c in self.rng.choice(n, size=k, replace=False))

    def schedule(self) -> list[tuple[int, Any]]:
        """(global step, stage) for every round of every stage."""
        steps, step = [], 0
        for stage in self.server.stages():
            for _ in range(stage.rounds):
                steps.append((step, stage))
                step += 1
        return steps

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> "Loop":
        if self.checkpoint_dir:
            self.try_resume()
        if self.start_step == 0:  # stages shared with runs that agree up to them (rayfl.stage_cache)
            self.stage_reuse = StageReuse.open(self)
        self.reported = self.start_step - 1
        self.setup_done = self.start_step > 0
        self.setup_reported = self.setup_done
        for cb in self.callbacks:
            cb.on_start(self)
        schedule = self.schedule()
        self.keep_snapshot(self.snapshot(self.start_step - 1))
        i = self.start_step
        while True:
            try:
                if i == len(schedule):
                    if self.stage_reuse:
                        self.stage_reuse.close()
                    for cb in self.callbacks:
                        cb.on_end(self)
                    return self
                step, stage = schedule[i]
                self.run_step(step, stage, last=step == len(schedule) - 1)
            except ClientsLost as lost:  # client actors died: restore the last snapshot, replay from there
                self.unfinished = None  # a round not yet reported is replayed with the others
                i = self.recover(lost, min(i, len(schedule) - 1))
                continue
            except BaseException:
                self.finish_after_failure()
                raise
            i += 1

    def run_step(self, step: int, stage, last: bool) -> None:
        """Setup (before the first round), then one round: train, then evaluate and keep; the round is
        reported (:meth:`finish_round`) once its evaluation is back."""
        if not self.setup_done:
            self.setup_metrics = self.server.setup(self.call) or {}
            self.setup_done = True
            if not self.setup_reported:
                for cb in self.callbacks:
                    cb.on_setup(self)
                self.setup_reported = True
        if self.stop_requested:  # the round under way is reported on the way out (finish_after_failure)
            raise RunStopped(f"stopped on request before round {step}")
        participants = self.sample(stage)
        self.call_seconds = self.reporting_seconds = 0.0
        self.stage, self.step, self.private_calls = stage, step, 0
        t0 = time.perf_counter()
        metrics = dict(self.server.run_round(stage, step, participants, self.call) or {})
        metrics["round_seconds"] = time.perf_counter() - t0 - self.reporting_seconds
        warnings = list(self.server.warnings())
        metrics["client_call_seconds"] = self.call_seconds
        self.finish_round()  # a round that made no client call has not reported the one before yet
        evaluated = last or step % self.cfg.eval_every == 0
        t1 = time.perf_counter()
        evaluation = None
        if evaluated:  # every client's personalized model on its own test split
            messages = self.server.eval_messages(stage, step, list(range(self.cfg.clients)))
            evaluation = self.runtime.submit("evaluate", messages)
        snapshot_due = self.cfg.snapshot_every and (step + 1) % self.cfg.snapshot_every == 0
        snap = None
        if snapshot_due:  # asked for behind the evaluation (which leaves every client as it is)
            t2 = time.perf_counter()
            snap = self.snapshot(step, self.runtime.save_clients())
            metrics["snapshot_seconds"] = time.perf_counter() - t2
        if self.restarts:
            metrics["client_restarts"] = self.restarts
        # the server's round artifacts now: the next round may change it before this one is reported
        record = RoundRecord(step, stage.name, participants, metrics, artifacts=self.server.round_artifacts(step),
                             warnings=warnings)
        if evaluated and self.user_dp is not None:
            record.epsilon = privacy.epsilon(self.dp_history, self.user_dp.delta, self.user_dp.accountant)
        self.unfinished = (record, evaluation, t1, snap)
        checkpoint_due = self.checkpoint_dir and self.cfg.checkpoint_every and (step + 1) % self.cfg.checkpoint_every == 0
        stage_end = self.stage_reuse is not None and step in self.stage_reuse.ends
        if last or checkpoint_due or stage_end or not self.runtime.pipelined:
            self.finish_round()  # a checkpoint reads the clients as this round leaves them: now, not later

    def finish_round(self) -> None:
        """Report the round whose evaluation was asked for: its records and their summary, its history row,
        its snapshot kept, the callbacks, a checkpoint when one is due. Under a pipelined runtime this waits
        for the next round's first client call (:meth:`call`), so that the clients train while this process
        summarises and reports; a host runs its calls in order, so that call sees the clients as this
        round left them."""
        if self.unfinished is None:
            return
        record, evaluation, t_eval, snap = self.unfinished
        self.unfinished = None
        step, metrics = record.step, record.metrics
        if evaluation is not None:
            record.per_client = evaluation.result()
            if record.epsilon is not None:  # every user's ε (user-level DP), beside each client's accuracy
                for rec in record.per_client.values():
                    rec["dp_epsilon"] = record.epsilon
            metrics["eval_seconds"] = time.perf_counter() - t_eval  # from asking to having every record
            metrics.update(round_summary(record.per_client))
        self.check_finite(step, metrics, record)  # before it is reported, kept or checkpointed
        if evaluation is not None:
            self.last_eval = record.per_client
        self.history.append({"step": step, "stage": record.stage, **metrics})
        if self.stage_reuse:
            self.stage_reuse.after_round(self, step)
        if snap is not None:  # the round is done: its snapshot may be replayed from
            snap.update(history=len(self.history), last_eval=self.last_eval)
            self.keep_snapshot(snap)
        if step > self.reported:
            for cb in self.callbacks:
                cb.on_round(self, record)
            self.reported = step
        if self.checkpoint_dir and self.cfg.checkpoint_every and (step + 1) % self.cfg.checkpoint_every == 0:
            for cb in self.callbacks:  # a run resumed from this checkpoint does not report these rounds again
                cb.on_checkpoint(self)
            self.save_checkpoint(step)

    def check_finite(self, step: int, metrics: dict, record: RoundRecord) -> None:
        """Diverged when the round's training loss or a client's evaluation loss is not finite."""
        problem = round_problem(metrics, record.per_client, len(record.participants))
        if problem is not None:
            self.diverged(step, problem)

    def diverged(self, step: int, problem: str) -> None:
        """End the run at ``step``: what is not finite, whether the server's model is, and what to change."""
        try:
            if "global model" not in problem and self.global_model_nan():
                problem += "; its global model has NaN or inf weights"
        except Exception:  # noqa: BLE001 - the divergence is the error to report
            pass
        raise Diverged(step + 1, self.cfg.algo, problem, step_size_hint(self.cfg, self.prepared.params))

    def global_model_nan(self) -> bool:
        """Whether the server's global model (its final_model, where it has one) holds a NaN or an infinity."""
        final = self.server.final_model()
        return final is not None and model_has_nan(self.runtime.get([final])[0])

    def finish_after_failure(self) -> None:
        """The run is failing: report the round that was waiting, if it can be, so that nothing it logged is
        lost (its evaluation was asked for before the failure)."""
        try:
            self.finish_round()
        except Exception:  # noqa: BLE001 - the failure already raised is the one to show
            self.unfinished = None

    @property
    def final(self) -> dict:
        """The final round's metrics (the reported result)."""
        return self.history[-1] if self.history else {}

    # --- checkpoints (on disk) and snapshots (in memory) --------------------------------------------
    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """Whether ``directory`` holds a checkpoint to resume from (an old pickle one counts, to be refused)."""
        return any(os.path.isfile(os.path.join(directory, name)) for name in (CHECKPOINT_FILE, LEGACY_CHECKPOINT))

    def checkpoint_path(self, directory: str | None = None) -> str:
        return os.path.join(directory or self.checkpoint_dir, CHECKPOINT_FILE)

    def save_checkpoint(self, step: int, directory: str | None = None) -> None:
        """Everything needed to go on after the round ``step``: server, clients, RNGs and history, as plain
        data (rayfl.snapshot), with the rayfl version and the config it belongs to (in ``directory``,
        default the run's checkpoint directory; the stage cache passes its own). A global model that is not
        finite is never written: the run has diverged, and the checkpoint on disk stays the last finite one."""
        if self.global_model_nan():
            self.diverged(step, "global model has NaN or inf weights")
        self._write_checkpoint(step, {"server": self.server.state_dict(), "clients": self.runtime.client_states(),
                                      "rng": self.rng.bit_generator.state,
                                      "server_rng": self.server.rng.bit_generator.state,
                                      "history": self.history, "last_eval": self.last_eval,
                                      "setup_metrics": self.setup_metrics, "dp_history": self.dp_history}, directory)

    def checkpoint_snapshot(self, snap: dict) -> tuple[str, int] | None:
        """The in-memory snapshot ``snap`` written as the run's checkpoint, with no client actor to ask: when
        the clients' hosts are gone for good. Not when the run keeps no checkpoints, the snapshot is from
        before the first round or its clients are not held here, or the checkpoint on disk is as new.
        Returns (directory, round) of the checkpoint left, or None."""
        if not self.checkpoint_dir or snap["step"] < 0:
            return None
        on_disk = (self.read_checkpoint(self.checkpoint_dir, self.cfg) if self.has_checkpoint(self.checkpoint_dir)
                   else None)
        if on_disk is not None and on_disk["step"] >= snap["step"]:
            return self.checkpoint_dir, on_disk["step"]
        clients: dict = {}
        kept_state = getattr(self.runtime, "kept_state", lambda part: part)  # a save the runtime left in place
        for parts in snap["clients"]:  # a chain of saves, oldest first, one part per host
            for part in parts:
                try:
                    part = kept_state(part)
                except ClientsLost:
                    part = None
                if not isinstance(part, dict):
                    return (self.checkpoint_dir, on_disk["step"]) if on_disk is not None else None
                clients.update(part)
        driver = snapshot.loads(snap["driver"])
        self._write_checkpoint(snap["step"], {"server": driver["server"], "clients": clients, "rng": driver["rng"],
                                              "server_rng": driver["server_rng"],
                                              "history": self.history[:snap["history"]],
                                              "last_eval": snap["last_eval"], "setup_metrics": snap["setup_metrics"],
                                              "dp_history": driver["dp_history"]})
        return self.checkpoint_dir, snap["step"]

    def _write_checkpoint(self, step: int, parts: dict, directory: str | None = None) -> None:
        values, digest = config_fingerprint(self.cfg)
        state = {"rayfl_version": _version(), "config_hash": digest, "config": values, "step": step, **parts}
        path = self.checkpoint_path(directory)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        snapshot.save(path, state)  # atomic: never a half-written checkpoint

    @staticmethod
    def read_checkpoint(directory: str, cfg, same_config: bool = True) -> dict | None:
        """The checkpoint in ``directory``, or None; UserError when it is not this rayfl's, not this config's
        (unless ``same_config`` is off: a shared stage, whose key already says what it depends on),
        unreadable, or an old pickle file (never opened: unpickling can run code)."""
        path = os.path.join(directory, CHECKPOINT_FILE)
        if not os.path.isfile(path):
            legacy = os.path.join(directory, LEGACY_CHECKPOINT)
            if os.path.isfile(legacy):
                raise UserError(f"checkpoint={legacy}: a pickle checkpoint of an older rayfl, not loaded (loading "
                                "pickle can run code); start a new run")
            return None
        try:
            state = snapshot.load(path)
            missing = _CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else _CHECKPOINT_KEYS
            if missing:
                raise snapshot.SnapshotError(f"not a rayfl checkpoint: no {', '.join(sorted(missing))}")
            for cid, blob in state["clients"].items():  # opaque bytes until a client loads them: check them here
                try:
                    snapshot.loads(blob)
                except snapshot.SnapshotError as e:
                    raise snapshot.SnapshotError(f"clients[{cid}]: {e}") from None
        except (OSError, snapshot.SnapshotError, AttributeError, TypeError) as e:
            raise UserError(f"checkpoint={path}: unreadable ({e})") from None
        if state["rayfl_version"] != _version():
            raise UserError(f"checkpoint={path}: written by rayfl {state['rayfl_version']}, this is rayfl "
                            f"{_version()}; finish the run with that version or start a new one")
        values, digest = config_fingerprint(cfg)
        if same_config and state["config_hash"] != digest:
            old = state["config"] if isinstance(state["config"], dict) else {}
            changed = [k for k in sorted(set(values) | set(old)) if values.get(k) != old.get(k)]
            detail = "; ".join(f"{k} was {old.get(k)!r}, now {values.get(k)!r}" for k in changed[:3])
            raise UserError(f"checkpoint={path}: written for another config ({detail or 'hash differs'}); "
                            "resume with the run's own config")
        return state

    def try_resume(self, directory: str | None = None) -> bool:
        """Go on from the checkpoint in ``directory`` (default the run's); False when there is none. A
        directory given explicitly is a shared stage (rayfl.stage_cache): its config may differ downstream."""
        state = self.read_checkpoint(directory or self.checkpoint_dir, self.cfg, same_config=directory is None)
        if state is None:
            return False
        self.server.load_state_dict(state["server"])
        self.runtime.load_client_states(state["clients"])
        self.rng.bit_generator.state = state["rng"]
        self.server.rng.bit_generator.state = state["server_rng"]
        self.history = state["history"]
        self.last_eval = state["last_eval"]
        self.setup_metrics = state["setup_metrics"]
        self.dp_history = [list(h) for h in state.get("dp_history", [])]
        self.start_step = state["step"] + 1
        return True

    def snapshot(self, step: int, clients=None) -> dict:
        """Where to go back to after round ``step`` (-1: before setup), held in memory. The runtime keeps the
        clients' state without waiting (under Ray: driver-owned objects, which outlive a dead actor), or
        ``clients`` is what it returned when asked earlier in the round; the driver's state is copied as
        plain-data bytes, since servers update their arrays in place. History only grows, so its length is
        enough (a round's snapshot gets it, and the round's records, when the round is reported)."""
        driver = {"server": self.server.state_dict(), "rng": self.rng.bit_generator.state,
                  "server_rng": self.server.rng.bit_generator.state, "dp_history": self.dp_history}
        clients = self.runtime.save_clients() if clients is None else clients
        return {"step": step, "clients": clients, "driver": snapshot.dumps(driver),
                "history": len(self.history), "last_eval": self.last_eval, "setup_metrics": self.setup_metrics,
                "setup_done": self.setup_done}

    def restore(self, snap: dict) -> int:
        """Put clients and driver back as they were at ``snap``; returns the index of the round to run next."""
        self.runtime.restore_clients(snap["clients"])  # first: if this fails, nothing else has changed
        driver = snapshot.loads(snap["driver"])
        self.server.load_state_dict(driver["server"])
        self.rng.bit_generator.state = driver["rng"]
        self.server.rng.bit_generator.state = driver["server_rng"]
        self.dp_history = [list(h) for h in driver["dp_history"]]
        del self.history[snap["history"]:]
        self.last_eval, self.setup_metrics, self.setup_done = snap["last_eval"], snap["setup_metrics"], snap["setup_done"]
        return snap["step"] + 1

    def keep_snapshot(self, snap: dict) -> None:
        """Two are kept: the newest may have been cut short by the very fault it is meant to undo. The runtime
        first makes the clients' part outlive their hosts (under Ray: copied into this process)."""
        keep = getattr(self.runtime, "keep_clients", None)
        if keep is not None:
            keep(snap["clients"])
        self.snapshots = [*self.snapshots[-1:], snap]

    def recover(self, lost: ClientsLost, step: int) -> int:
        """Client actors died in round ``step`` (the runtime has restarted them): restore every client and the
        driver from the newest usable snapshot and return the round to replay from. At most max_restarts."""
        self.restarts += 1
        if self.restarts > self.cfg.max_restarts:
            raise ClientsLost(f"client actors died {self.restarts} times, more than max_restarts="
                              f"{self.cfg.max_restarts}; last: {lost}") from lost
        for snap in reversed(self.snapshots):
            try:
                resume_at = self.restore(snap)
            except ClientsLost as again:  # this snapshot went down with its actor
                lost = again
                continue
            except NoCapacity as e:  # the clients cannot be hosted again: keep what the newest snapshot holds
                e.checkpoint = self.checkpoint_snapshot(self.snapshots[-1])
                raise
            self.snapshots = [snap]
            event = {"step": step, "from_step": snap["step"], "restarts": self.restarts, "cause": str(lost)}
            for cb in self.callbacks:
                cb.on_recover(self, event)
            return resume_at
        raise ClientsLost(f"client actors died in round {step} and no snapshot could be restored: {lost}") from lost


CHECKPOINT_FILE = "checkpoint.rayfl"  # rayfl.snapshot format: JSON header and raw arrays, no pickle
LEGACY_CHECKPOINT = "checkpoint.pkl"  # what rayfl wrote before; refused, never opened
_CHECKPOINT_KEYS = frozenset({"rayfl_version", "config_hash", "config", "step", "server", "clients", "rng",
                              "server_rng", "history", "last_eval", "setup_metrics"})
def config_fingerprint(cfg) -> tuple[dict, str]:
    """The config values that determine a run's results (not :data:`rayfl.config.NOT_RESULTS`), and their
    hash."""
    values = {k: v for k, v in cfg.to_flat().items() if k not in NOT_RESULTS}
    text = json.dumps(values, sort_keys=True, default=repr)
    return values, hashlib.sha256(text.encode()).hexdigest()


def _version() -> str:
    from rayfl import __version__

    return __version__
