"""Hang detection: a per-rank thread that notices a step running far longer than usual.

A collective that never completes (a dead peer, a wedged link, a rank stuck in I/O) otherwise blocks
until the process-group timeout, silently. The watchdog compares the running step's age with a
multiple of the median of recent steps (kept per stage: longer sequences make slower steps) and with
an absolute limit; past either it writes every thread's stack (faulthandler) to run_dir/hang/rank<r>.txt,
and the flight recorder's record of this rank's last collectives (when TORCH_FR_BUFFER_SIZE > 0, as the SLURM
job sets it) to the file torch's own timeout dump would use (TORCH_FR_DUMP_TEMP_FILE<rank>, by default
run_dir/hang/nccl_trace_rank_<r>): the watchdog usually fires before the process group's timeout, and os._exit
leaves no later chance. Read them with `torchfrtrace RUN_DIR/hang -p nccl_trace_rank_`: the rank whose
collectives stop short of its peers' is the one the others wait for. It says which rank and step, rank 0
writes status.json ("hung"), and it ends the process with outcome.HUNG so the launcher can restart it.
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

import torch
import torch.distributed as dist

from moe_pretrain.operations.outcome import HUNG, write_status

log = logging.getLogger(__name__)

MIN_STEPS_FOR_MEDIAN = 3
FR_TRACE_PREFIX = "nccl_trace_rank_"
"""The flight recorder's dump files in run_dir/hang/, <prefix><rank>: the watchdog's and NCCL's own on a timeout
(the SLURM job points TORCH_FR_DUMP_TEMP_FILE there)."""


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
        trace = self.dump_flight_recorder()
        log.critical(message + (f"; the flight recorder's last collectives are in {trace}" if trace else ""))
        if self.rank == 0:
            write_status(self.dump_dir.parent, HUNG, step, message, None)
        os._exit(HUNG)  # the main thread is stuck: no clean shutdown is possible from here

    def dump_flight_recorder(self) -> Path | None:
        """Write the flight recorder's entries of this rank (NCCL's on GPUs, else the generic one, which gloo
        feeds), as torch's analyser reads them; None when it records nothing (TORCH_FR_BUFFER_SIZE unset or 0)."""
        if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0 or not dist.is_initialized():
            return None
        c10d = torch._C._distributed_c10d
        nccl = "nccl" in str(dist.get_backend()) and hasattr(c10d, "_dump_nccl_trace")
        trace = c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace()
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or str(self.dump_dir / FR_TRACE_PREFIX)
        path = Path(f"{prefix}{self.rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(trace)
        return path

    def close(self) -> None:
        self._stop.set()
