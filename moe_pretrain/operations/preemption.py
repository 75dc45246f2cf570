"""Stop signals and timed saves: handlers set flags; all ranks agree on them at the next step boundary.

SLURM sends the job script a signal some time before the end (sbatch --signal=B:USR2@lead); the script
forwards it through srun and torchrun to every training process. Ctrl-C sends SIGINT to the process
(or to torchrun, which forwards it once to its workers: they run in sessions of their own). Ranks
receive signals at different moments, mid-step, so a flag is only acted on after a step, once an
all-reduce has made every rank see it: then all of them save the same step together. The same
all-reduce carries each rank's "a timed checkpoint is due" bit, so clocks that disagree by a few
milliseconds still agree on the step that saves.

The job script also gives the processes a clock time to stop by (MOE_PRETRAIN_STOP_AT, unix seconds: the job's
end less the signal lead): a rank whose next step would end past it asks for a stop in the same all-reduce, and the
run saves and exits as preempted, should SLURM's signal come late or not at all (a signal lost in a container, a
site that strips --signal): a long save never ends as TIMEOUT without a status.

A second SIGINT exits at once (code 130, nothing saved): the way out when the checkpoint itself hangs.
"""

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime

import torch
import torch.distributed as dist

from moe_pretrain.config.errors import ConfigError
from moe_pretrain.operations.outcome import INTERRUPTED
from parallel.collectives import all_reduce_max

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
HANDLED_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)
_NONE, _CLOCK, _PREEMPT, _INTERRUPT = 0, 1, 2, 3
"""Agreed by a max over ranks: an interrupt outranks a preemption signal, which outranks the clock."""
STOP_AT_VARIABLE = "MOE_PRETRAIN_STOP_AT"


def stop_at_from_env() -> float | None:
    """The clock time (unix seconds) the job script asks the run to have stopped by; None when it sets none."""
    text = os.environ.get(STOP_AT_VARIABLE, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{STOP_AT_VARIABLE}={text!r} must be a time in unix seconds (the job script sets it)") \
            from None


@dataclass(frozen=True)
class Agreement:
    """What every rank decided together after a step."""

    signal_name: str | None
    """The stop signal's name (this rank's, or "a signal on another rank"); None to keep training."""
    interrupted: bool
    """The stop is a Ctrl-C (SIGINT): status "interrupted", exit 130, not a requeue."""
    save_due: bool
    """Some rank's timed checkpoint interval has passed."""


class StopSignals:
    def __init__(self, stop_at: float | None = None):
        self.received: str | None = None
        self.stop_at = stop_at
        """Unix seconds by which the run must have stopped (stop_at_from_env), or None."""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            log.error(f"second SIGINT: exiting at once with code {INTERRUPTED}, without a checkpoint")
            os._exit(INTERRUPTED)
        # Set before logging: a second signal may arrive while the line is written.
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:
            log.warning("SIGINT: finishing this step, then saving a checkpoint and exiting (SIGINT again: "
                        "exit at once)")

    def _code(self, next_step_s: float) -> int:
        if self.received is not None:
            return _INTERRUPT if self.received == "SIGINT" else _PREEMPT
        if self.stop_at is not None and time.time() + next_step_s >= self.stop_at:
            return _CLOCK
        return _NONE

    def agreed(self, distributed: bool, device: torch.device, save_due: bool = False,
               next_step_s: float = 0.0) -> Agreement:
        """The decision of all ranks (one small all-reduce when distributed). next_step_s: how long the next
        step is expected to take (the last one's time): the clock stop comes before a step that would end late."""
        code, due = self._code(next_step_s), save_due
        if distributed:
            flags = torch.tensor([code, int(save_due)], dtype=torch.int32, device=device)
            flags = all_reduce_max(flags, dist.group.WORLD)
            code, due = int(flags[0]), bool(flags[1])
        if code == _NONE:
            return Agreement(None, False, due)
        if code == _CLOCK:  # every rank names it alike: the time is the job script's, the same on all
            when = datetime.fromtimestamp(self.stop_at).strftime("%Y-%m-%d %H:%M:%S") if self.stop_at else "?"
            return Agreement(f"the job's time limit ({STOP_AT_VARIABLE}: stop by {when})", False, due)
        name = self.received or ("SIGINT on another rank" if code == _INTERRUPT else "a signal on another rank")
        return Agreement(name, code == _INTERRUPT, due)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
