"""The sweep's own record of its trials (``rayfl_trials.json`` in the sweep directory): for every trial its key,
the values it was given, its status and its last reported result, as plain JSON. The sweep process keeps it
(a Tune callback, :func:`ledger_callback`); ``rayfl tune --resume`` rebuilds the rest of a sweep from it and
from the trials' rayfl checkpoints, never from Tune's own state files (pickles, which run code when loaded).

A trial's key is the Tune trial id it first ran under; a trial continued by a resumed sweep carries it in its
config under :data:`TRIAL_KEY`, so it finds its checkpoint directory (``trials/<key>``) and its MLflow run.
"""

from __future__ import annotations

import json
import re
import math
import os

TRIALS_FILE = "rayfl_trials.json"
TRIAL_KEY = "rayfl_trial"  # in a trial's config: the key of the trial it continues
RUNNING, DONE, STOPPED, ERROR = "RUNNING", "DONE", "STOPPED", "ERROR"
STATUSES = (RUNNING, DONE, STOPPED, ERROR)


def trial_key(config: dict, trial_id: str) -> str:
    """The trial's key: the one it continues, else its own Tune trial id."""
    return str((config or {}).get(TRIAL_KEY) or trial_id)


def sampled(config: dict) -> dict:
    """The values a trial was given, without the key of the trial it continues."""
    return {k: v for k, v in (config or {}).items() if k != TRIAL_KEY}


def _plain(value):
    """A result value as JSON keeps it: finite numbers and short strings (NaN, arrays and objects dropped)."""
    if isinstance(value, bool):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy scalars
        value = value.item()
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str) and len(value) <= 500:
        return value
    return None


def plain_result(result: dict) -> dict:
    out = {}
    for k, v in (result or {}).items():
        if isinstance(k, str) and k not in ("config",):
            p = _plain(v)
            if p is not None:
                out[k] = p
    return out


def path_of(sweep_dir: str) -> str:
    return os.path.join(sweep_dir, TRIALS_FILE)


def write_records(sweep_dir: str, trials: dict) -> None:
    """Atomically: a sweep killed while writing leaves the previous version."""
    path = path_of(sweep_dir)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"trials": trials}, f, indent=1)
    os.replace(tmp, path)


def read_records(sweep_dir: str, swept: list[str]) -> dict:
    """The recorded trials, checked: ``{key: {"config", "status", "result"}}``; UserError naming the file and
    the entry when one is not what rayfl writes."""
    from rayfl.config import UserError, shown

    path = path_of(sweep_dir)
    if not os.path.isfile(path):
        raise UserError(f"--resume {sweep_dir!r}: no {TRIALS_FILE} there (a sweep of an older rayfl, or not a "
                        f"rayfl sweep); start it again")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0]})") from None
    trials = data.get("trials") if isinstance(data, dict) else None
    if not isinstance(trials, dict):
        raise UserError(f"{path}: must hold {{\"trials\": {{key: record}}}}")
    for key, rec in trials.items():
        where = f"{path}: trials.{key}"
        if not re.fullmatch(r"[\w.-]{1,200}", key) or key in (".", "..") or not isinstance(rec, dict):
            where = f"{path}: trials.{shown(key)}"
            raise UserError(f"{where}: not a trial record (a key of letters, digits, '_', '-' and '.', and a mapping)")
        if rec.get("status") not in STATUSES:
            raise UserError(f"{where}.status={rec.get('status')!r}: allowed: {', '.join(STATUSES)}")
        if not isinstance(rec.get("config"), dict) or set(rec["config"]) != set(swept):
            raise UserError(f"{where}.config: must give exactly the swept keys ({', '.join(swept) or 'none'})")
        if not isinstance(rec.get("result", {}), dict):
            raise UserError(f"{where}.result: must be a mapping")
        rec.setdefault("result", {})
    return trials


def ledger_callback(sweep_dir: str, records: dict):
    """A Tune callback (in the sweep process) keeping ``records`` and the file up to date: a trial's values
    when it starts, its last result as it reports, its status when it ends. A trial Tune retries after its
    process died stays RUNNING."""
    from ray import tune

    class Ledger(tune.Callback):
        def _record(self, trial) -> dict:
            key = trial_key(trial.config, trial.trial_id)
            rec = records.setdefault(key, {"config": sampled(trial.config), "status": RUNNING, "result": {}})
            return rec

        def _save(self) -> None:
            write_records(sweep_dir, records)

        def on_trial_start(self, iteration, trials, trial, **info):
            self._record(trial)["status"] = RUNNING
            self._save()

        def on_trial_result(self, iteration, trials, trial, result, **info):
            self._record(trial)["result"] = plain_result(result)
            self._save()

        def on_trial_complete(self, iteration, trials, trial, **info):
            rec = self._record(trial)
            if trial.last_result:
                rec["result"] = plain_result(trial.last_result)
            # a trial that reported its final result has its MLflow run's id; one a scheduler stopped has not
            rec["status"] = DONE if rec["result"].get("mlflow_run_id") else STOPPED
            self._save()

        def on_trial_error(self, iteration, trials, trial, **info):
            rec = self._record(trial)
            rec["status"] = ERROR
            rec["error"] = str(getattr(trial, "path", "") or "")
            self._save()

    return Ledger()
