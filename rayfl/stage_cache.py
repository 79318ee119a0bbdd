"""Stage reuse: runs whose inputs agree up to the end of a stage share that stage's result.

A run is a list of stages (``Server.stages()``). The loop's state at the end of a stage (server, every
client, RNGs, history: the content of a loop checkpoint) is a function of the config, the algorithm knobs
that this stage and the ones before it read (``Stage.depends_on``), the rayfl version and the data. The hash
of those is the stage's *key*; its checkpoint is kept in ``<stage_cache>/<key>/``. A run whose key is
there restores it and starts at the next stage, so PersFL trials that differ only in (λ, T) run FedAvg once,
and so do FedAvg-FT and FedMoE trials that differ only in their fine-tuning knobs.

The last stage is always computed (it is what a run is for). One run computes a key while the others with
the same key wait for it (a lock file next to the entry, taken over when its owner process is gone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import numpy as np

from rayfl.config import NOT_RESULTS



def data_identity(dataset, federation) -> str:
    """Digest of the arrays and of every client's split indices: the same data under another path agrees."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (dataset.x, dataset.y, federation.holdout,
                *(getattr(c, s) for c in federation.clients for s in ("train", "val", "test"))):
        a = np.ascontiguousarray(arr)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def stage_keys(cfg, params, stages, data_id: str, version: str) -> list[str]:
    """One key per stage: a hash of all that the state at the end of that stage depends on."""
    base = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_RESULTS and k != "params"}
    knobs = dataclasses.asdict(params)
    keys, names, read = [], [], set()
    for stage in stages:
        names.append([stage.name, stage.rounds, stage.sample])
        read |= set(knobs) if stage.depends_on is None else set(stage.depends_on)
        text = json.dumps({"rayfl": version, "config": base, "data": data_id, "stages": names,
                           "knobs": {k: knobs[k] for k in sorted(read)}}, sort_keys=True, default=str)
        keys.append(hashlib.sha256(text.encode()).hexdigest()[:20])
    return keys


class Lock:
    """Only one run computes a key; the others wait for it. A file created with O_EXCL holding the owner's
    host and pid; an owner process that is gone (or is this process: a run of ours that failed) is
    taken over."""

    def __init__(self, path: str, poll: float = 0.5):
        self.path, self.poll, self.held = path, poll, False

    def _stale(self) -> bool:
        try:
            with open(self.path) as f:
                host, pid = f.read().split()
        except (OSError, ValueError):
            return False  # being written: give it a moment
        if host != os.uname().nodename:
            return False  # another node: trust it
        if int(pid) == os.getpid():
            return True
        try:
            os.kill(int(pid), 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    def acquire(self, ready) -> bool:
        """Wait until ``ready()`` (return False: nothing to compute) or the lock is ours (return True)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        waited = False
        while True:
            if ready():
                return False
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale():
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                else:
                    if not waited:
                        print(f"rayfl: waiting for another run to compute a stage this run shares ({self.path})",
                              flush=True)
                    waited = True
                    time.sleep(self.poll)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.uname().nodename} {os.getpid()}")
            self.held = True
            if ready():  # finished between our check and our lock
                self.release()
                return False
            return True

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class StageReuse:
    """The loop's hook: :meth:`open` restores the deepest stored stage, :meth:`after_round` stores each
    stage at its end, :meth:`close` lets waiting runs go on."""

    def __init__(self, root: str, ends: dict[int, tuple[str, str]]):
        self.root = root
        self.ends = ends  # global step of a stage's last round -> (stage name, key), last stage excluded
        self.lock: Lock | None = None
        self.reused: tuple[str, str] | None = None  # (stage, key) restored, if any

    def entry(self, key: str) -> str:
        return os.path.join(self.root, key)

    @classmethod
    def open(cls, loop) -> "StageReuse | None":
        """None when the config has no ``stage_cache`` or nothing before the last stage can be shared."""
        import rayfl

        cfg, prepared = loop.cfg, loop.prepared
        if not cfg.stage_cache:
            return None
        stages = loop.server.stages()
        data_id = prepared.data_id or data_identity(prepared.dataset, prepared.federation)
        keys = stage_keys(cfg, loop.server.params, stages, data_id, rayfl.__version__)
        ends, step = {}, -1
        for stage, key in list(zip(stages, keys))[:-1]:
            step += stage.rounds
            if stage.rounds > 0:
                ends[step] = (stage.name, key)
        self = cls(os.path.expanduser(cfg.stage_cache), ends)
        if not ends:
            return self
        stored = lambda key: os.path.isfile(loop.checkpoint_path(self.entry(key)))  # noqa: E731
        deepest = ends[max(ends)][1]
        self.lock = Lock(self.entry(deepest) + ".lock")
        self.lock.acquire(lambda: stored(deepest))  # returns once it is stored, or it is ours to compute
        for step in sorted(ends, reverse=True):
            name, key = ends[step]
            if stored(key) and loop.try_resume(self.entry(key)):
                self.reused = (name, key)
                break
        return self

    def after_round(self, loop, step: int) -> None:
        if step in self.ends:
            name, key = self.ends[step]
            if not os.path.isfile(loop.checkpoint_path(self.entry(key))):
                loop.save_checkpoint(step, self.entry(key))
            if step == max(self.ends):
                self.close()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
