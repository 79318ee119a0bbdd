"""Console progress of a sweep: a Tune callback printing a line per trial start, round and end."""

from __future__ import annotations


# --------------------------------------------------------------------------------------------------
# Console progress
# --------------------------------------------------------------------------------------------------
def finished_count(trials, trial, total: int) -> tuple[int, int]:
    """(finished, total) when ``trial`` has just ended: Tune creates trials as it goes, so ``len(trials)`` is
    not the sweep's size; ``total`` is (the grid x --num-samples, or --num-samples)."""
    done = 1 + sum(t.status in ("TERMINATED", "ERROR") for t in trials if t is not trial)
    return done, max(total, len(trials))


def _progress_callback(metric: str, swept: list[str], quiet: bool, total: int = 0):
    from ray import tune

    class Progress(tune.Callback):
        def _label(self, trial) -> str:
            return ",".join(f"{k}={trial.config.get(k)}" for k in swept)

        def on_trial_start(self, iteration, trials, trial, **info):
            print(f"trial {trial.trial_id} started: {self._label(trial)}", flush=True)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if quiet:
                return
            value = result.get(metric)
            shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
            print(f"trial {trial.trial_id} round {result.get('round', '?')}/{result.get('total_rounds', '?')} "
                  f"[{result.get('stage', '')}] {metric} {shown}", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):
            done, n = finished_count(trials, trial, total)
            print(f"trial {trial.trial_id} done ({done}/{n} finished): {self._label(trial)}", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            done, n = finished_count(trials, trial, total)
            print(f"trial {trial.trial_id} FAILED ({done}/{n} finished): {self._label(trial)} (see {trial.path})",
                  flush=True)

    return Progress()
