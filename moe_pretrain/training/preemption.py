"""Stop signals and timed saves: handlers set flags; all ranks agree on them at the next step boundary.

SLURM sends the job script a signal some time before the end (sbatch --signal=B:USR2@lead); the script
forwards it through srun and torchrun to every training process. Ctrl-C sends SIGINT to the process
(or to torchrun, which forwards it once to its workers: they run in sessions of their own). Ranks
receive signals at different moments, mid-step, so a flag is only acted on after a step, once an
all-reduce has made every rank see it: then all of them save the same step together. The same
all-reduce carries each rank's "a timed checkpoint is due" bit, so clocks that disagree by a few
milliseconds still agree on the step that saves.

A second SIGINT exits at once (code 130, nothing saved): the way out when the checkpoint itself hangs.
"""

import logging
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_pretrain.training.outcome import INTERRUPTED
from parallel.collectives import all_reduce_max

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
HANDLED_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)
_NONE, _PREEMPT, _INTERRUPT = 0, 1, 2


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
    def __init__(self):
        self.received: str | None = None
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

    def _code(self) -> int:
        if self.received is None:
            return _NONE
        return _INTERRUPT if self.received == "SIGINT" else _PREEMPT

    def agreed(self, distributed: bool, device: torch.device, save_due: bool = False) -> Agreement:
        """The decision of all ranks (one small all-reduce when distributed)."""
        code, due = self._code(), save_due
        if distributed:
            flags = torch.tensor([code, int(save_due)], dtype=torch.int32, device=device)
            flags = all_reduce_max(flags, dist.group.WORLD)
            code, due = int(flags[0]), bool(flags[1])
        if code == _NONE:
            return Agreement(None, False, due)
        name = self.received or ("SIGINT on another rank" if code == _INTERRUPT else "a signal on another rank")
        return Agreement(name, code == _INTERRUPT, due)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
