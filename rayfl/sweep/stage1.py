"""Shared work: PersFL trials that differ only in (λ, T) share one stage-1 cache directory, keyed by a
hash of the rest of the resolved config; a lock file makes the first trial compute it while the others
wait (:class:`Stage1Lock`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time

from rayfl.config import make_config
from rayfl.sweep.space import Plan

# Knobs that stage 1 of PersFL does not read (they shape stage 2 only): trials that differ only in these
# share one stage 1. PersFL keeps both teachers (best round and final) in its cache, so `teacher` is free too.
STAGE1_FREE = {"persfl": ("lam", "T", "lam_grid", "T_grid", "distill_epochs", "variant", "teacher", "stage1_cache")}
# Config fields that do not change what an experiment computes (left out of the stage-1 key).
NOT_COMPUTED = {"run_name", "experiment", "tracking_uri", "out_dir", "checkpoint_every"}


# --------------------------------------------------------------------------------------------------
# PersFL: one stage 1 per distinct rest-of-config
# --------------------------------------------------------------------------------------------------
def stage1_key(values: dict, algo: str) -> str:
    """Hash of everything but the knobs stage 1 does not depend on (seed included)."""
    free = set(STAGE1_FREE.get(algo, ()))
    cfg = make_config(None, values)
    flat = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_COMPUTED and k != "params"}
    from rayfl.algorithms import get_algorithm

    params = dataclasses.asdict(get_algorithm(algo).make_params(cfg.params))
    flat["params"] = {k: v for k, v in params.items() if k not in free}
    text = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Stage1Lock:
    """Only one trial computes a given stage-1 cache; the others wait for it, then read it.

    The lock is a file created with O_EXCL next to the cache directory, holding the owner's host and pid.
    It is released when the owner's experiment ends (or fails); a lock whose owner process is gone (a
    trial stopped or killed) is taken over. Waiting trials hold their placement group meanwhile, which only
    delays them: the owner has its own group.
    """

    def __init__(self, cache_dir: str, poll: float = 0.5):
        self.cache_dir = cache_dir
        self.path = cache_dir.rstrip("/") + ".lock"
        self.poll = poll
        self.held = False

    def _owner_alive(self) -> bool:
        try:
            with open(self.path) as f:
                host, pid = f.read().split()
        except (OSError, ValueError):
            return True  # being written: give it a moment
        if host != os.uname().nodename:
            return True  # another node: trust it
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def acquire(self, ready) -> bool:
        """Wait until ``ready()`` (the cache is complete: return False, nothing to do) or the lock is ours
        (return True: compute it). ``ready`` is checked before each attempt."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        while True:
            if ready():
                return False
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._owner_alive():
                    try:
                        os.unlink(self.path)  # a dead owner's lock
                    except FileNotFoundError:
                        pass
                    continue
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


def stage1_ready(cache_dir: str) -> bool:
    """Whether a stage-1 cache is complete: PersFL writes its one file atomically (tmp + rename) when
    stage 1 ends, so its presence is the signal (waiting trials go on then, not when the owner ends)."""
    from rayfl.algorithms.persfl import CACHE_FILE

    return os.path.isfile(os.path.join(cache_dir, CACHE_FILE))


def stage1_groups(plan: Plan, stage1_root: str) -> dict[str, dict] | None:
    """Stage-1 key -> one grid sample of that key, for every grid point; None when a random key that
    stage 1 depends on is swept (the keys are then known only per trial: the trials' lock handles it)."""
    free = set(STAGE1_FREE.get(plan.algo, ()))
    if any(k not in free for k in plan.space.random):
        return None
    keys = [k for k in plan.space.grid if k not in free]
    groups: dict[str, dict] = {}
    firsts = {k: v[0] for k, v in plan.space.grid.items() if k in free}
    for combo in itertools.product(*(plan.space.grid[k] for k in keys)):
        sample = {**firsts, **dict(zip(keys, combo))}
        values = plan.values(sample)
        groups.setdefault(stage1_key(values, plan.algo), sample)
    return groups


def warm_stage1(meta: dict, plan: Plan, quiet: bool) -> None:
    """Before the trials: compute each distinct stage 1 once, with the whole cluster (a plain experiment,
    logged as a child run of the sweep with role ``stage1``), so that every (λ, T) trial only reads it."""
    from rayfl.actors.launch import launch
    from rayfl.cli import format_round
    from rayfl.experiment import prepare

    groups = stage1_groups(plan, meta["stage1_root"])
    if groups is None:
        print("rayfl tune: stage 1 depends on a randomly drawn key: trials share it through a lock instead",
              flush=True)
        return
    for i, (key, sample) in enumerate(groups.items()):
        cache = os.path.join(meta["stage1_root"], key)
        if stage1_ready(cache):
            continue
        values = plan.values(sample)
        values["params"]["stage1_cache"] = cache
        lock = Stage1Lock(cache)
        if not lock.acquire(lambda: stage1_ready(cache)):
            continue
        try:
            print(f"rayfl tune: stage 1 {i + 1}/{len(groups)} (key {key}, shared by its trials), whole cluster",
                  flush=True)
            tracking = {"tracking_uri": meta["tracking_uri"], "experiment_id": meta["experiment_id"],
                        "parent_run_id": meta["parent_run_id"], "run_name": f"{meta['name']}/stage1-{key}",
                        "extra_params": {"tune_role": "stage1", "tune_stage1_key": key, "tune_sweep": meta["name"]}}
            show = None if quiet else (lambda rec: print("  stage 1: " + format_round(rec), flush=True))
            launch(prepare(make_config(None, values)), tracking, on_round=show)
        finally:
            lock.release()
        if not stage1_ready(cache):
            raise RuntimeError(f"stage 1 for key {key} ended without writing {cache}")
