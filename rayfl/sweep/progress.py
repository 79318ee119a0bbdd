"""Console progress of a sweep: a Tune callback printing a line per trial start, round (unless quiet) and end,
``k/N done`` with the time left at the pace of the trials finished so far, and the trials that reuse a stage
another trial computed."""

from __future__ import annotations

import time


# --------------------------------------------------------------------------------------------------
# Console progress
# --------------------------------------------------------------------------------------------------
def finished_count(trials, trial, total: int) -> tuple[int, int]:
    """(finished, total) when ``trial`` has just ended: Tune creates trials as it goes, so ``len(trials)`` is
    not the sweep's size; ``total`` is (the grid x --num-samples, or --num-samples)."""
    done = 1 + sum(t.status in ("TERMINATED", "ERROR") for t in trials if t is not trial)
    return done, max(total, len(trials))


def eta_line(done: int, total: int, ended_here: int, elapsed: float) -> str:
    """``3/35 done, elapsed 0:21, eta 3:44``: the time left at the pace of the trials that ended since this
    process began (their start-up and any trials running beside them counted)."""
    from rayfl.progress import format_seconds

    left = f", eta {format_seconds(elapsed / ended_here * (total - done))}" if ended_here and done < total else ""
    return f"{done}/{total} done, elapsed {format_seconds(elapsed)}{left}"


def silent_reporter():
    """Tune's own progress reporter, silenced: rayfl prints its trials' lines itself (:func:`_progress_callback`).
    Without one, Tune makes its default, and in a notebook that is the JupyterNotebookReporter, which clears
    the cell's output (IPython's ``clear_output``) as it is made, even at ``verbose=0``: the sweep's plan and
    the lines before it would vanish."""
    from ray.tune import ProgressReporter

    class Silent(ProgressReporter):
        def should_report(self, trials, done: bool = False) -> bool:
            return False

        def report(self, trials, done: bool, *sys_info: str) -> None:
            pass

    return Silent()


def _progress_callback(metric: str, swept: list[str], quiet: bool, total: int = 0, write=None, already: int = 0):
    """``already``: trials a resumed sweep had finished before (counted as done, never run again)."""
    from ray import tune

    from rayfl.sweep.records import trial_key

    say = write or (lambda line: print(line, flush=True))

    class Progress(tune.Callback):
        def __init__(self):
            super().__init__()
            self.t0 = time.monotonic()
            self.ended = 0  # trials that ended since this process began (a resumed sweep's earlier ones apart)
            self.reuse_told: set[str] = set()

        def _label(self, trial) -> str:
            return ",".join(f"{k}={trial.config.get(k)}" for k in swept)

        @staticmethod
        def _key(trial) -> str:  # a continued trial goes by the key it was first run under
            return trial_key(trial.config, trial.trial_id)

        def on_trial_start(self, iteration, trials, trial, **info):
            go_on = " (goes on from its checkpoint)" if self._key(trial) != trial.trial_id else ""
            say(f"trial {self._key(trial)} started: {self._label(trial)}{go_on}")

        def on_trial_recover(self, iteration, trials, trial, **info):
            say(f"trial {self._key(trial)} lost its process; retried ({trial.num_failures} so far), going on from "
                f"its last checkpoint ({self._label(trial)})")

        def on_trial_result(self, iteration, trials, trial, result, **info):
            reused = result.get("reused_rounds")
            if reused and trial.trial_id not in self.reuse_told:
                self.reuse_told.add(trial.trial_id)
                say(f"trial {self._key(trial)} reuses rounds 1-{int(reused)}: a shared stage another trial "
                    f"computed ({self._label(trial)})")
            if quiet:
                return
            value = result.get(metric)
            shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
            say(f"trial {self._key(trial)} round {result.get('round', '?')}/{result.get('total_rounds', '?')} "
                f"[{result.get('stage', '')}] {metric} {shown}")

        def _ended(self, trials, trial, what: str) -> None:
            self.ended += 1
            done, n = finished_count(trials, trial, max(0, total - already))
            say(f"rayfl tune: {eta_line(done + already, n + already, self.ended, time.monotonic() - self.t0)} "
                f"(trial {self._key(trial)} {what})")

        def on_trial_complete(self, iteration, trials, trial, **info):
            value = (trial.last_result or {}).get(metric)
            shown = f": {metric} {value:.4f}" if isinstance(value, (int, float)) else ""
            self._ended(trials, trial, f"{self._label(trial)}{shown}")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._ended(trials, trial, f"{self._label(trial)} FAILED, see {trial.path}")

    return Progress()
