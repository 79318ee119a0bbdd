"""A checkpoint to resume from, checked before Ray starts against a fresh run of its config.

A checkpoint is plain data (rayfl.snapshot), but it may have been edited by hand or cut short: a client's
weights NaN, an array of the wrong shape, a key or a client missing, a step outside the run. Each is refused
in one line naming the file and the field, instead of failing rounds later inside an actor. Nothing here
names an algorithm: the server's state is compared with what a fresh Server of this config holds, and each
client's with a fresh client of this federation (rayfl.snapshot.check_like), then loaded into them. A Server
whose arrays change shape during a run names them in ``growing_state`` (checked by dtype and dimensions).
"""

from __future__ import annotations

import os

import numpy as np

from rayfl.algorithms.base import capability
from rayfl.config import UserError, shown
from rayfl.user_input import MAX_MAGNITUDE


def check_recorded_plugins(run_dir: str) -> None:
    """The plugins a run directory records (``plugins.yaml``) must be loaded already, by ``--plugin`` /
    ``plugins=`` or ``$RAYFL_PLUGINS``: a directory handed over names code, it never runs it. A recorded plugin
    counts as given again when its algorithms are registered now (a file moved elsewhere, given by its new path)
    or its source was loaded; the first that is neither is one line naming it."""
    from rayfl import algorithms as registry
    from rayfl.config import load_yaml
    from rayfl.plugins import RECORD, load_plugins, loaded_sources

    path = os.path.join(run_dir, RECORD)
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path) or os.path.islink(path):
        raise UserError(f"--resume {run_dir!r}: {RECORD} there is not a regular file")
    data = load_yaml(path, "plugin record") or {}
    entries = data.get("plugins") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("source"), str)
            and isinstance(e.get("algorithms") or [], list) for e in entries):
        raise UserError(f"--resume {run_dir!r}: {RECORD} there is not a list of plugins (source, algorithms)")
    load_plugins(env=True)  # entry points and $RAYFL_PLUGINS, which the user's environment names
    known, loaded = set(registry.algorithm_names()), set(loaded_sources())
    for entry in entries:
        source = entry["source"]
        names = [n for n in entry.get("algorithms") or [] if isinstance(n, str)]
        if (names and all(n in known for n in names)) or source in loaded:
            continue
        what = f" (algorithm {', '.join(names)})" if names else ""
        if source.startswith("python:"):
            raise UserError(f"--resume {run_dir!r}: its algorithm {', '.join(names)} was registered from Python "
                            f"({source[len('python:'):]}); register it again (rayfl.register_algorithm) before "
                            f"resuming")
        raise UserError(f"--resume {run_dir!r}: the run used plugin {shown(source)}{what}, which is not loaded; "
                        f"a run directory's plugins are never imported from it: give it again with --plugin "
                        f"FILE_OR_MODULE (or $RAYFL_PLUGINS) if you trust it")


def check_checkpoint(run_dir: str, prepared) -> None:
    """UserError ``checkpoint=PATH: FIELD: problem`` for the first part of the checkpoint in ``run_dir`` that a
    run of ``prepared`` could not go on from."""
    from rayfl import checkpoint
    from rayfl.snapshot import SnapshotError, check_like, loads

    state = checkpoint.read(run_dir, prepared.cfg)  # readable, this version's and this config's
    if state is None:
        return
    path = checkpoint.path_in(run_dir)

    def refuse(problem: str):
        return UserError(f"checkpoint={path}: {problem}")

    cfg = prepared.cfg
    server = _fresh_server(prepared)
    total = sum(stage.rounds for stage in server.stages())
    step = state["step"]
    if type(step) is not int or not 0 <= step < total:
        raise refuse(f"step={str(step)[:40]}: must be a round index in [0, {total - 1}] (this run has {total} "
                     f"rounds)")
    for key in ("rng", "server_rng"):
        try:
            np.random.default_rng().bit_generator.state = state[key]
        except (TypeError, ValueError, KeyError) as e:
            raise refuse(f"{key}: not a random generator's state ({type(e).__name__}: {str(e)[:100]})") from None
    for key, kind in (("history", list), ("setup_metrics", dict), ("dp_history", list)):
        if key in state and not isinstance(state[key], kind):
            raise refuse(f"{key}: a {type(state[key]).__name__}, expected a {kind.__name__}")
    stages = [stage.name for stage in server.stages()]
    problem = _history_problem(state["history"], step, stages)
    if problem:
        raise refuse(problem)
    if "dp_history" in state and not all(isinstance(h, (list, tuple)) and all(_number(v) for v in h)
                                         for h in state["dp_history"]):
        raise refuse("dp_history: every entry must be a list of numbers")
    template = server.state_dict()
    for name in capability(server, "growing_state"):  # arrays a Server declares to change shape over a run
        if isinstance(template.get(name), np.ndarray):
            template[name] = np.empty((0,) * template[name].ndim, template[name].dtype)
    for name in capability(server, "client_ids"):  # the ids a Server keeps must be clients of this run
        ids = state["server"].get(name) if isinstance(state["server"], dict) else None
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(
                type(c) is int and 0 <= c < cfg.clients for c in ids)):
            raise refuse(f"server.{name}={str(ids)[:60]}: must be a list of this run's client ids (0 to "
                         f"{cfg.clients - 1})")
    big = _beyond_magnitude(state["server"], "server")
    if big:
        raise refuse(f"{big}: holds values beyond {MAX_MAGNITUDE:g} in magnitude (a run's state never does)")
    try:
        check_like(state["server"], template, "server")
        server.load_state_dict(state["server"])
    except SnapshotError as e:
        raise refuse(str(e)) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise refuse(f"server: cannot be loaded ({type(e).__name__}: {str(e)[:100]})") from None

    clients = state["clients"]
    expected = set(range(cfg.clients))
    if not isinstance(clients, dict) or set(clients) != expected:
        have = set(clients) if isinstance(clients, dict) else set()
        missing, extra = sorted(expected - have), sorted(map(str, have - expected))
        raise refuse(f"clients: {'no client ' + str(missing[0]) if missing else 'client ' + extra[0]}"
                     f"{'' if missing else ' is not one'} of this run's {cfg.clients} (0 to {cfg.clients - 1})")
    host, restore = _fresh_host(prepared)
    try:
        fresh = host.state()
        for cid in sorted(clients):
            blob = clients[cid]
            if not isinstance(blob, (bytes, bytearray)):
                raise refuse(f"clients[{cid}]: a {type(blob).__name__}, expected a client's snapshot bytes")
            try:
                tree = loads(blob)
                check_like(tree, loads(fresh[cid]), f"clients[{cid}]")
                _check_weights(tree, prepared.initial, f"clients[{cid}].model")
                host.load_state({cid: bytes(blob)})
            except SnapshotError as e:
                raise refuse(str(e)) from None
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
                raise refuse(f"clients[{cid}]: cannot be loaded ({type(e).__name__}: {str(e)[:100]})") from None
    finally:
        restore()


def _beyond_magnitude(tree, where: str) -> str | None:
    """The path of the first floating-point array in ``tree`` holding a finite value beyond MAX_MAGNITUDE."""
    stack = [(tree, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            stack += [(x, f"{path}.{k}") for k, x in v.items()]
        elif isinstance(v, (list, tuple)):
            stack += [(x, f"{path}[{i}]") for i, x in enumerate(v)]
        elif isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size:
            finite = v[np.isfinite(v)]
            if finite.size and np.abs(finite).max() > MAX_MAGNITUDE:
                return path
    return None


def _number(v) -> bool:
    return type(v) in (int, float) or isinstance(v, (np.integer, np.floating))


def _history_problem(history: list, step: int, stages: list) -> str | None:
    """What is wrong with the rounds' records a checkpoint holds, if anything: each is a mapping with the
    round's ``step`` (increasing, at most the checkpoint's), the name of one of the run's stages, and numbers
    (NaN included: a diverged round is one) under names of metrics."""
    last = -1
    for i, rec in enumerate(history):
        if not isinstance(rec, dict):
            return f"history[{i}]: a {type(rec).__name__}, expected a round's record (a mapping)"
        s = rec.get("step")
        if type(s) is not int or not last < s <= step:
            return f"history[{i}].step={str(s)[:40]}: must be a round index after the one before, at most {step}"
        if rec.get("stage") not in stages:
            return (f"history[{i}].stage={str(rec.get('stage'))[:40]}: not one of this run's stages "
                    f"({', '.join(stages)})")
        for key, value in rec.items():
            if key not in ("step", "stage") and not (isinstance(key, str) and _number(value)):
                return f"history[{i}][{str(key)[:40]!r}]: must be a metric name with a number"
        last = s
    return None


def _check_weights(tree, initial: np.ndarray, where: str) -> None:
    """A client's own weights (None until it has any): the network's parameter vector, finite."""
    from rayfl.snapshot import SnapshotError

    w = tree.get("model") if isinstance(tree, dict) else None
    if w is None:
        return
    if not isinstance(w, np.ndarray) or w.shape != initial.shape or w.dtype.kind != "f":
        what = f"shape {w.shape} of {w.dtype}" if isinstance(w, np.ndarray) else f"a {type(w).__name__}"
        raise SnapshotError(f"{where}: {what}, expected the network's {initial.size} weights {initial.shape}")
    if not np.isfinite(w).all():
        raise SnapshotError(f"{where}: holds NaN or infinite values")


def _fresh_server(prepared):
    """The algorithm's Server as a new run of this config starts it, in this process (handles are values)."""
    algo = prepared.algorithm
    return algo.Server(prepared.params, prepared.info, lambda v: v, lambda hs: list(hs),
                       np.random.default_rng(prepared.cfg.seed), prepared.initial)


def _fresh_host(prepared):
    """Every client as a new run starts it, on one host in this process, and how to undo the thread limits a
    host sets for itself (this process goes on to start Ray)."""
    import torch

    from rayfl.host import ClientHost

    threads = torch.get_num_threads()
    fed = prepared.federation
    host = ClientHost(prepared.host_spec(), {c: fed.clients[c] for c in range(prepared.cfg.clients)})

    def restore() -> None:
        host._blas_limit.restore_original_limits()
        torch.set_num_threads(threads)

    return host, restore


STEP_SIZE_CHANGES = "step_size_changes"  # the checkpoint's record of step sizes changed on resume


def with_step_sizes(run_dir: str, cfg, changes: dict):
    """The saved config ``cfg`` of a run directory with some of its step sizes changed, for a run resumed after
    a divergence (``rayfl run --resume DIR --lr 0.05``). Only step sizes may change (``lr`` and the algorithm's
    ``*lr`` knobs): anything else would make the checkpoint another config's. The checkpoint is re-keyed to the
    new config, recording each change and the round it applies from, and config.yaml says the new values, so
    a later ``--resume`` goes on with them. Returns the new Config."""
    import dataclasses

    import yaml

    from rayfl import checkpoint, snapshot
    from rayfl.algorithms import get_algorithm
    from rayfl.config import make_config
    from rayfl.divergence import step_sizes

    sizes = step_sizes(cfg, get_algorithm(cfg.algo).make_params(cfg.params))
    asked = {**{k: v for k, v in changes.items() if k != "params"},
             **{f"param.{k}": v for k, v in (changes.get("params") or {}).items()}}
    flags = ", ".join("--lr" if k == "lr" else f"-p {k[len('param.'):]}" for k in sizes)
    for key, value in asked.items():
        if key not in sizes:
            name = f"params.{key[len('param.'):]}" if key.startswith("param.") else key
            raise UserError(f"--resume {run_dir!r} with {name}={shown(value)}: a resumed run keeps its saved "
                            f"config but for its step sizes ({flags}); start a new run to change {name}")
    values = dataclasses.asdict(cfg)
    values.update({k: v for k, v in changes.items() if k != "params"})
    values["params"] = {**cfg.params, **(changes.get("params") or {})}
    try:
        new = make_config(None, values)
    except UserError as e:
        raise UserError(f"--resume {run_dir!r}: {e}") from None
    new_sizes = step_sizes(new, get_algorithm(new.algo).make_params(new.params))
    changed = {k: [sizes[k], new_sizes[k]] for k in sizes if sizes[k] != new_sizes[k]}
    if not changed:
        return cfg
    state = checkpoint.read(run_dir, cfg)
    flat, digest = checkpoint.config_fingerprint(new)
    state[STEP_SIZE_CHANGES] = [*state.get(STEP_SIZE_CHANGES, []), {"from_round": state["step"] + 2, **changed}]
    state.update(config=flat, config_hash=digest)
    snapshot.save(checkpoint.path_in(run_dir), state)  # atomic: the old one until the new is whole
    path = os.path.join(run_dir, "config.yaml")
    with open(path) as f:
        record = yaml.safe_load(f)
    record.update({k: v for k, v in dataclasses.asdict(new).items() if k in ("lr", "params")})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(record, f, sort_keys=False)
    os.replace(tmp, path)
    return new


def step_size_note(changes: list[dict]) -> str:
    """The step sizes a resumed run changed, as one line for its MLflow run: ``lr 0.1 -> 0.05 from round 4``."""
    return "; ".join(f"{k[len('param.'):] if k.startswith('param.') else k} {v[0]:g} -> {v[1]:g} from round "
                     f"{c['from_round']}" for c in changes for k, v in c.items() if k != "from_round")
