"""Console progress of a sweep: a Tune callback printing a line per trial start, round and end."""

from __future__ import annotations


# --------------------------------------------------------------------------------------------------
# Console progress
# --------------------------------------------------------------------------------------------------
def _progress_callback(metric: str, swept: list[str], quiet: bool):
    from ray import tune

    class Progress(tune.Callback):
        def _label(self, trial) -> str:
            return " ".join(f"{k}={trial.config.get(k)}" for k in swept)

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
            done = 1 + sum(t.status in ("TERMINATED", "ERROR") for t in trials if t is not trial)
            print(f"trial {trial.trial_id} done ({done}/{len(trials)} finished): {self._label(trial)}", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"trial {trial.trial_id} FAILED: {self._label(trial)} (see {trial.path})", flush=True)

    return Progress()
