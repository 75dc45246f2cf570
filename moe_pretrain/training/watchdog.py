"""Hang detection: a per-rank thread that notices a step running far longer than usual.

A collective that never completes (a dead peer, a wedged link, a rank stuck in I/O) otherwise blocks
until the process-group timeout, silently. The watchdog compares the running step's age with a
multiple of the median of recent steps (kept per stage: longer sequences make slower steps) and with
an absolute limit; past either it writes every thread's stack (faulthandler) to run_dir/hang/rank<r>.txt,
says which rank and step, and ends the process with outcome.HUNG so the launcher can restart it.
"""

import faulthandler
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path

from moe_pretrain.training.outcome import HUNG

log = logging.getLogger(__name__)

MIN_STEPS_FOR_MEDIAN = 3


class StepWatchdog:
    def __init__(self, run_dir: str | Path, rank: int, multiple: float, min_s: float, timeout_s: float,
                 poll_s: float = 0.25):
        self.dump_dir = Path(run_dir) / "hang"
        self.rank, self.multiple, self.min_s, self.timeout_s, self.poll_s = rank, multiple, min_s, timeout_s, poll_s
        self.durations: deque[float] = deque(maxlen=50)
        self._step: int | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        if multiple > 0 or timeout_s > 0:
            self._thread.start()

    def limit(self) -> tuple[float, str] | None:
        """(seconds a step may take, why), from what is known now; None = no limit yet."""
        limits = []
        if self.timeout_s > 0:
            limits.append((self.timeout_s, f"the absolute limit train.hang_timeout_s={self.timeout_s:g}"))
        if self.multiple > 0 and len(self.durations) >= MIN_STEPS_FOR_MEDIAN:
            median = statistics.median(self.durations)
            limits.append((max(self.multiple * median, self.min_s),
                           f"train.hang_multiple={self.multiple:g} x the median step {median:.3g} s "
                           f"(at least train.hang_min_s={self.min_s:g})"))
        return min(limits) if limits else None

    def begin(self, step: int) -> None:
        with self._lock:
            self._step, self._started = step, time.monotonic()

    def end(self) -> None:
        with self._lock:
            self.durations.append(time.monotonic() - self._started)
            self._step = None

    def new_stage(self) -> None:
        """Step times change with the sequence length: judge the new stage by its own steps."""
        self.durations.clear()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                step, elapsed = self._step, time.monotonic() - self._started
                limit = self.limit()
            if step is not None and limit is not None and elapsed > limit[0]:
                self._fire(step, elapsed, limit[1])

    def _fire(self, step: int, elapsed: float, why: str) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank{self.rank}.txt"
        message = (f"watchdog (rank {self.rank} on {socket.gethostname()}): step {step} has run {elapsed:.1f} s, "
                   f"more than {why}; "
                   f"the stacks of every thread are in {path}; exiting with code {HUNG}")
        with path.open("w") as dump:
            dump.write(message + "\n\n")
            dump.flush()
            faulthandler.dump_traceback(dump, all_threads=True)
        log.critical(message)
        os._exit(HUNG)  # the main thread is stuck: no clean shutdown is possible from here

    def close(self) -> None:
        self._stop.set()
