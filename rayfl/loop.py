"""The one round loop every algorithm runs in.

It owns what no algorithm should write again: participant sampling, dispatch with timing, evaluation
of every client's personalized model on its own test split, the summary across clients, callbacks
(MLflow, Tune, progress), checkpoints and resuming. The final round is what is reported, never the
best round on test.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfl.metrics import round_summary
from rayfl.stage_cache import StageReuse


class RunStopped(Exception):
    """The submitter asked the run to stop (Ctrl-C, a Tune scheduler): it ends between two rounds."""


class Callback:
    """Hooks the loop calls; tracking, Tune reporting and progress display are callbacks."""

    def on_start(self, loop: "Loop") -> None: ...
    def on_setup(self, loop: "Loop") -> None: ...
    def on_round(self, loop: "Loop", record: "RoundRecord") -> None: ...
    def on_end(self, loop: "Loop") -> None: ...


@dataclass
class RoundRecord:
    step: int  # global round counter across stages (the MLflow step)
    stage: str
    participants: list[int]
    metrics: dict[str, float]  # the algorithm's own, the summary across clients, timings
    per_client: dict[int, dict] = field(default_factory=dict)  # evaluation records, when evaluated


class Loop:
    def __init__(self, prepared, runtime, callbacks=(), checkpoint_dir: str | None = None):
        self.prepared = prepared
        self.cfg = prepared.cfg
        self.runtime = runtime
        self.callbacks = list(callbacks)
        self.checkpoint_dir = checkpoint_dir
        self.rng = np.random.default_rng([self.cfg.seed, 1])  # participant sampling
        algo = prepared.algorithm
        self.server = algo.Server(algo.make_params(self.cfg.params), prepared.info, runtime.put, runtime.get,
                                  np.random.default_rng([self.cfg.seed, 2]), prepared.initial)
        self.history: list[dict] = []
        self.last_eval: dict[int, dict] = {}
        self.setup_metrics: dict = {}
        self.start_step = 0
        self.call_seconds = 0.0
        self.stop_requested = False
        self.stage_reuse = None

    # --- pieces ---------------------------------------------------------------------------------
    def call(self, step: str, messages: dict[int, dict], reduce=None) -> dict[int, dict]:
        t0 = time.perf_counter()
        out = self.runtime.call(step, messages, reduce)
        self.call_seconds += time.perf_counter() - t0
        return out

    def sample(self, stage) -> list[int]:
        n = self.cfg.clients
        if not stage.sample or self.cfg.participation >= 1:
            return list(range(n))
        k = max(1, int(round(self.cfg.participation * n)))
        return sorted(int(c) for c in self.rng.choice(n, size=k, replace=False))

    def evaluate(self, stage, step: int) -> dict[int, dict]:
        cids = list(range(self.cfg.clients))
        return self.runtime.call("evaluate", self.server.eval_messages(stage, step, cids))

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
        for cb in self.callbacks:
            cb.on_start(self)
        if self.start_step == 0:
            self.setup_metrics = self.server.setup(self.call) or {}
            for cb in self.callbacks:
                cb.on_setup(self)
        schedule = self.schedule()
        for step, stage in schedule[self.start_step:]:
            if self.stop_requested:
                raise RunStopped(f"stopped on request before round {step}")
            participants = self.sample(stage)
            self.call_seconds = 0.0
            t0 = time.perf_counter()
            metrics = dict(self.server.run_round(stage, step, participants, self.call) or {})
            metrics["round_seconds"] = time.perf_counter() - t0
            metrics["client_call_seconds"] = self.call_seconds
            last = step == len(schedule) - 1
            per_client: dict[int, dict] = {}
            if last or step % self.cfg.eval_every == 0:
                t1 = time.perf_counter()
                per_client = self.evaluate(stage, step)
                metrics["eval_seconds"] = time.perf_counter() - t1
                metrics.update(round_summary(per_client))
                self.last_eval = per_client
            record = RoundRecord(step, stage.name, participants, metrics, per_client)
            self.history.append({"step": step, "stage": stage.name, **metrics})
            if self.stage_reuse:
                self.stage_reuse.after_round(self, step)
            for cb in self.callbacks:
                cb.on_round(self, record)
            if self.checkpoint_dir and self.cfg.checkpoint_every and (step + 1) % self.cfg.checkpoint_every == 0:
                self.save_checkpoint(step)
        if self.stage_reuse:
            self.stage_reuse.close()
        for cb in self.callbacks:
            cb.on_end(self)
        return self

    @property
    def final(self) -> dict:
        """The final round's metrics (the reported result)."""
        return self.history[-1] if self.history else {}

    # --- checkpoints ----------------------------------------------------------------------------
    CHECKPOINT_FILE = "checkpoint.pkl"

    def checkpoint_path(self, directory: str | None = None) -> str:
        return os.path.join(directory or self.checkpoint_dir, self.CHECKPOINT_FILE)

    @classmethod
    def has_checkpoint(cls, directory: str) -> bool:
        """Whether ``directory`` holds a checkpoint this loop can go on from (``rayfl run --resume`` asks
        before anything starts)."""
        return os.path.isfile(os.path.join(directory, cls.CHECKPOINT_FILE))

    def save_checkpoint(self, step: int, directory: str | None = None) -> None:
        """Everything needed to go on after the round ``step``: server, clients, RNGs and history
        (in ``directory``, default the run's checkpoint directory; the stage cache passes its own)."""
        state = {"step": step, "server": self.server.state_dict(), "clients": self.runtime.client_states(),
                 "rng": self.rng.bit_generator.state, "server_rng": self.server.rng.bit_generator.state,
                 "history": self.history, "last_eval": self.last_eval, "setup_metrics": self.setup_metrics}
        path = self.checkpoint_path(directory)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(state, f)
        os.replace(tmp, path)  # never leave a half-written checkpoint

    def try_resume(self, directory: str | None = None) -> bool:
        path = self.checkpoint_path(directory)
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            state = pickle.load(f)
        self.server.load_state_dict(state["server"])
        self.runtime.load_client_states(state["clients"])
        self.rng.bit_generator.state = state["rng"]
        self.server.rng.bit_generator.state = state["server_rng"]
        self.history = state["history"]
        self.last_eval = state["last_eval"]
        self.setup_metrics = state["setup_metrics"]
        self.start_step = state["step"] + 1
        return True
