"""The tracking writer: one background thread that runs logging jobs in order, below its process's priority, and
counts the CPU they cost (what tracking costs a run)."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

WRITER_NICER = 4  # the writer thread's niceness above its process's (Ray's workers run at 15)


def yield_cpu() -> None:
    """The calling thread WRITER_NICER below its process (Linux sets niceness per thread): it takes the CPU
    that the rounds' threads and processes leave."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICER))
    except (AttributeError, OSError):
        pass


class Writer:
    """One background thread that runs logging jobs in order; ``flush`` waits for all of them and re-raises
    the first error, so a failing store is reported instead of silently dropping values. ``idle`` runs
    whenever no job came for ``every`` seconds, and before a flush completes (sending what jobs batched)."""

    def __init__(self, idle: Callable[[], None] = lambda: None, every: float = 1.0):
        self.cpu_seconds = 0.0  # CPU time this thread has spent on jobs: what tracking costs the run
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._reported = False
        self._idle, self._every = idle, every
        self._thread = threading.Thread(target=self._work, name="rayfl-mlflow-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._every)
            except queue.Empty:
                self._run(self._idle)
                continue
            try:
                if job is None:
                    return
                self._run(job)
            finally:
                self._jobs.task_done()

    def _run(self, job: Callable[[], None]) -> None:
        if self._error is None:
            t0 = time.thread_time()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - kept (every later job skipped) and raised once
                self._error = e
            self.cpu_seconds += time.thread_time() - t0

    def check(self) -> None:
        """Raise the first error of a job, once, without waiting for the queue."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def flush(self) -> None:
        self._jobs.put(self._idle)
        self._jobs.join()
        self.check()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
