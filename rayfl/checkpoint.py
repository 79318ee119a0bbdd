"""A run's checkpoint on disk: its file, what it holds, and the checks made before one is read back.

A checkpoint is plain data (:mod:`rayfl.snapshot`: a JSON header and raw arrays, never pickle), written atomically,
with the rayfl version and the config it belongs to (their hash, and the values, to say what changed). What is in
it is the loop's business (:meth:`rayfl.loop.Loop.save_checkpoint`); whether a checkpoint can be gone on from,
field by field, is :mod:`rayfl.resume`'s.
"""

from __future__ import annotations

import hashlib
import json
import os

from rayfl import snapshot
from rayfl.config import NOT_RESULTS, UserError

FILE = "checkpoint.rayfl"  # rayfl.snapshot format: JSON header and raw arrays, no pickle
LEGACY_FILE = "checkpoint.pkl"  # what rayfl wrote before; refused, never opened
KEYS = frozenset({"rayfl_version", "config_hash", "config", "step", "server", "clients", "rng", "server_rng",
                  "history", "last_eval", "setup_metrics"})


def path_in(directory: str) -> str:
    return os.path.join(directory, FILE)


def exists(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint to resume from (an old pickle one counts, to be refused)."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in (FILE, LEGACY_FILE))


def config_fingerprint(cfg) -> tuple[dict, str]:
    """The config values that determine a run's results (not :data:`rayfl.config.NOT_RESULTS`), and their
    hash."""
    values = {k: v for k, v in cfg.to_flat().items() if k not in NOT_RESULTS}
    text = json.dumps(values, sort_keys=True, default=repr)
    return values, hashlib.sha256(text.encode()).hexdigest()


def write(directory: str, cfg, step: int, parts: dict) -> None:
    """The state after round ``step`` (``parts``: server, clients, RNGs, history, ...) as ``directory``'s
    checkpoint, stamped with this rayfl's version and ``cfg``'s fingerprint; atomic: never a half-written file."""
    values, digest = config_fingerprint(cfg)
    state = {"rayfl_version": version(), "config_hash": digest, "config": values, "step": step, **parts}
    path = path_in(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    snapshot.save(path, state)


def read(directory: str, cfg, same_config: bool = True) -> dict | None:
    """The checkpoint in ``directory``, or None; UserError when it is not this rayfl's, not this config's
    (unless ``same_config`` is off: a shared stage, whose key already says what it depends on),
    unreadable, or an old pickle file (never opened: unpickling can run code)."""
    path = path_in(directory)
    if not os.path.isfile(path):
        legacy = os.path.join(directory, LEGACY_FILE)
        if os.path.isfile(legacy):
            raise UserError(f"checkpoint={legacy}: a pickle checkpoint of an older rayfl, not loaded (loading "
                            "pickle can run code); start a new run")
        return None
    try:
        state = snapshot.load(path)
        missing = KEYS - set(state) if isinstance(state, dict) else KEYS
        if missing:
            raise snapshot.SnapshotError(f"not a rayfl checkpoint: no {', '.join(sorted(missing))}")
        for cid, blob in state["clients"].items():  # opaque bytes until a client loads them: check them here
            try:
                snapshot.loads(blob)
            except snapshot.SnapshotError as e:
                raise snapshot.SnapshotError(f"clients[{cid}]: {e}") from None
    except (OSError, snapshot.SnapshotError, AttributeError, TypeError) as e:
        raise UserError(f"checkpoint={path}: unreadable ({e})") from None
    if state["rayfl_version"] != version():
        raise UserError(f"checkpoint={path}: written by rayfl {state['rayfl_version']}, this is rayfl "
                        f"{version()}; finish the run with that version or start a new one")
    values, digest = config_fingerprint(cfg)
    if same_config and state["config_hash"] != digest:
        old = state["config"] if isinstance(state["config"], dict) else {}
        changed = [k for k in sorted(set(values) | set(old)) if values.get(k) != old.get(k)]
        detail = "; ".join(f"{k} was {old.get(k)!r}, now {values.get(k)!r}" for k in changed[:3])
        raise UserError(f"checkpoint={path}: written for another config ({detail or 'hash differs'}); "
                        "resume with the run's own config")
    return state


def version() -> str:
    from rayfl import __version__

    return __version__
