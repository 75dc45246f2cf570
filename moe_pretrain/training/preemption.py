"""Preemption: a signal handler sets a flag; all ranks agree on it at the next step boundary.

SLURM sends the job script a signal some time before the end (sbatch --signal=B:USR2@lead); the script
forwards it through srun and torchrun (--signals-to-handle) to every training process. Ranks receive it
at different moments, mid-step, so the flag is only acted on after a step, once an all-reduce has made
every rank see it: then all of them save the same step together.
"""

import signal
import threading

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self):
        self.received: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def agreed(self, distributed: bool, device: torch.device) -> str | None:
        """The signal's name if any rank has received one (a collective when distributed)."""
        if not distributed:
            return self.received
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (self.received or "a signal on another rank") if int(flag) else None

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
