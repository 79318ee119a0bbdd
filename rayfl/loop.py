"""The one round loop every algorithm runs in.

It owns what no algorithm should write again: participant sampling, dispatch with timing, evaluation
of every client's personalized model on its own test split, the summary across clients, callbacks
(MLflow, Tune, progress), and when checkpoints and snapshots are taken. The final round is what is reported,
never the best round on test. Under Ray a round is reported while the clients run the next round's first call
(:meth:`Loop.finish_round`): the driver's summary and logging no longer sit between two rounds. What a checkpoint
is lives in :mod:`rayfl.checkpoint`, the way back from lost client actors in :mod:`rayfl.recovery`, user-level
DP's noise in :mod:`rayfl.user_dp`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfl import checkpoint
from rayfl.algorithms.base import Message, Upload
from rayfl.divergence import Diverged, model_has_nan, round_problem, step_size_hint
from rayfl.metrics import round_summary
from rayfl.recovery import NoCapacity, Recovery  # noqa: F401 - NoCapacity: what a run that ends for want of room raises
from rayfl.runtime import ClientsLost
from rayfl.stage_cache import StageReuse
from rayfl.user_dp import UserLevelDP


class RunStopped(Exception):
    """The submitter asked the run to stop (Ctrl-C, a Tune scheduler): it ends between two rounds."""


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
    total = len(loop.schedule())
    return {"step": record.step, "stage": record.stage, "metrics": record.metrics,
            "participants": len(record.participants), "total": total, "warnings": record.warnings,
            "evaluated": loop.evaluates(record.step),
            "evaluated_left": sum(loop.evaluates(s) for s in range(record.step + 1, total))}


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
        self.step_size_changes: list[dict] = []  # step sizes lowered on a resume, kept in each checkpoint
        self.call_seconds = self.reporting_seconds = 0.0
        self.unfinished: tuple | None = None  # (record, evaluation, when asked, snapshot) of a round not yet reported
        self.stop_requested = False
        self.setup_done = self.setup_reported = False
        self.reported = -1  # the last round the callbacks have seen (replayed rounds are not shown twice)
        self.recovery = Recovery(self)
        self.stage_reuse = None
        self.user_dp = UserLevelDP.of(self.cfg)  # None without user-level DP
        self.stage, self.step, self.private_calls = None, -1, 0

    @property
    def restarts(self) -> int:
        """Client-actor faults survived."""
        return self.recovery.restarts

    @property
    def dp_history(self) -> list:
        """User-level DP: the run's accountant history, one step per averaging round (empty without it)."""
        return self.user_dp.history if self.user_dp is not None else []

    # --- pieces ---------------------------------------------------------------------------------
    def call(self, step: str, messages: dict[int, Message], reduce=None) -> dict[int, Upload]:
        """A server's client call. While the clients work on it, the round before is reported (see
        :meth:`finish_round`); that time is the previous round's, not this call's."""
        t0 = time.perf_counter()
        clipped = self.user_dp.clipped(reduce, self.server) if self.user_dp is not None else None
        if clipped is not None:  # user-level DP: each host sums its clients' clipped updates instead
            reduce = clipped
        pending = self.runtime.submit(step, messages, reduce)
        t1 = time.perf_counter()
        self.finish_round()
        t2 = time.perf_counter()
        out = pending.result()
        if clipped is not None:  # noised once here, the call's own draw (a replayed round draws the same)
            rate = self.cfg.participation if self.stage is not None and self.stage.sample else 1.0
            key = (self.step, self.private_calls)
            self.private_calls += 1
            out.reduced[reduce.key] = self.user_dp.average(out.reduced[reduce.key],
                                                           self.runtime.get([clipped.start])[0], rate, key)
        self.call_seconds += time.perf_counter() - t0 - (t2 - t1)
        self.reporting_seconds += t2 - t1
        return out

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
        self.recovery.keep(self.recovery.take(self.start_step - 1))
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
                i = self.recovery.recover(lost, min(i, len(schedule) - 1))
                continue
            except BaseException:
                self.finish_after_failure()
                raise
            i += 1

    def evaluates(self, step: int) -> bool:
        """Whether round ``step`` evaluates every client: each ``eval_every``-th, and the last."""
        return step == len(self.schedule()) - 1 or step % self.cfg.eval_every == 0

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
        evaluated = last or self.evaluates(step)
        t1 = time.perf_counter()
        evaluation = None
        if evaluated:  # every client's personalized model on its own test split
            messages = self.server.eval_messages(stage, step, list(range(self.cfg.clients)))
            evaluation = self.runtime.submit("evaluate", messages)
        snapshot_due = self.cfg.snapshot_every and (step + 1) % self.cfg.snapshot_every == 0
        snap = None
        if snapshot_due:  # asked for behind the evaluation (which leaves every client as it is)
            t2 = time.perf_counter()
            snap = self.recovery.take(step, self.runtime.save_clients())
            metrics["snapshot_seconds"] = time.perf_counter() - t2
        if self.restarts:
            metrics["client_restarts"] = self.restarts
        # the server's round artifacts now: the next round may change it before this one is reported
        record = RoundRecord(step, stage.name, participants, metrics, artifacts=self.server.round_artifacts(step),
                             warnings=warnings)
        if evaluated and self.user_dp is not None:
            record.epsilon = self.user_dp.epsilon()
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
            self.recovery.keep(snap)
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

    # --- the driver's state, for checkpoints (rayfl.checkpoint) and snapshots (rayfl.recovery) -------------
    def driver_state(self) -> dict:
        """Server, participant sampling and server RNGs, user-level DP's accountant: as plain data."""
        return {"server": self.server.state_dict(), "rng": self.rng.bit_generator.state,
                "server_rng": self.server.rng.bit_generator.state, "dp_history": self.dp_history}

    def load_driver_state(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.rng.bit_generator.state = state["rng"]
        self.server.rng.bit_generator.state = state["server_rng"]
        if self.user_dp is not None:
            self.user_dp.history = [list(h) for h in state.get("dp_history", [])]

    # --- checkpoints ------------------------------------------------------------------------------
    has_checkpoint = staticmethod(checkpoint.exists)
    read_checkpoint = staticmethod(checkpoint.read)

    def checkpoint_path(self, directory: str | None = None) -> str:
        return checkpoint.path_in(directory or self.checkpoint_dir)

    def save_checkpoint(self, step: int, directory: str | None = None) -> None:
        """Everything needed to go on after the round ``step``: server, clients, RNGs and history (in
        ``directory``, default the run's checkpoint directory; the stage cache passes its own). A global model
        that is not finite is never written: the run has diverged, and the checkpoint on disk stays the last
        finite one."""
        if self.global_model_nan():
            self.diverged(step, "global model has NaN or inf weights")
        driver = self.driver_state()
        checkpoint.write(directory or self.checkpoint_dir, self.cfg, step, {
            "server": driver["server"], "clients": self.runtime.client_states(), "rng": driver["rng"],
            "server_rng": driver["server_rng"], "history": self.history, "last_eval": self.last_eval,
            "setup_metrics": self.setup_metrics, "dp_history": driver["dp_history"],
            "step_size_changes": self.step_size_changes})

    def try_resume(self, directory: str | None = None) -> bool:
        """Go on from the checkpoint in ``directory`` (default the run's); False when there is none. A
        directory given explicitly is a shared stage (rayfl.stage_cache): its config may differ downstream."""
        state = checkpoint.read(directory or self.checkpoint_dir, self.cfg, same_config=directory is None)
        if state is None:
            return False
        self.load_driver_state(state)
        self.runtime.load_client_states(state["clients"])
        self.history = state["history"]
        self.last_eval = state["last_eval"]
        self.setup_metrics = state["setup_metrics"]
        self.step_size_changes = state.get("step_size_changes", [])  # rayfl.resume.with_step_sizes
        self.start_step = state["step"] + 1
        return True
