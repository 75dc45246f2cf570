"""What this rank's steps spent their time on over a window of steps, for the straggler check
(parallel/stragglers.py).

A rank's step time is set by the slowest rank it waits for, so it says nothing about the rank itself. What does:
its time blocked in collectives, by group (measured where every collective passes: parallel/collectives.py's
block meter), and what is left when that, the data wait and the checkpoint stall are taken off the step: its
own compute. A slow rank has a long compute and short waits; the ranks that wait for it the opposite. Also its
experts' received rows (the dispatcher counts them from the split sizes it reads anyway), so that a rank slow
because routing sends it more tokens is told from a rank slow because of its hardware.

The step's edges are timed on the host (time.perf_counter): the step already ends in one host read (its loss
and gradient norm), and nothing here adds one. Its parts (forward and backward, the optimizer) and its
collectives' waits are timed as the device runs them: on CPU (gloo) by the host's clock, since every wait is
the host's; on a GPU by two CUDA events on the current stream around each (under NCCL a collective's wait is
the current stream's, not the host's), all read once at the end of the window. Only the CPU path has run: the
events path has not run on a GPU, and at full size it records two events per collective (thousands a step).
"""

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.model.moe import LatentMoE
from parallel.collectives import CollectiveObserver, observing
from parallel.state import ParallelContext
from parallel.stragglers import WindowFigures


class StepTelemetry(CollectiveObserver):
    """Sums this rank's figures over the current window; the trainer adds each step's, the block meter each
    collective's wait (an observer of the collectives: parallel/collectives.observing)."""

    def __init__(self, ctx: ParallelContext, model: nn.Module, on: bool):
        """on: the straggler check reads the windows; off, nothing is timed or kept (no meter on the collectives,
        no CUDA events piling up unread)."""
        self.on = on
        self.window = WindowFigures()
        self._events: list[tuple[dict, str, torch.cuda.Event, torch.cuda.Event]] = []
        """The window's device-timed blocks not yet read (CUDA): where to add each, under what name."""
        self._cuda = ctx.device.type == "cuda"
        self._names = group_names(ctx)
        self._dispatchers = [module.dispatcher for module in model.modules() if isinstance(module, LatentMoE)]
        self._rows_before = self._rows_received()

    @contextlib.contextmanager
    def blocking(self, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Time a collective call that may wait for the group's other ranks (parallel/collectives.py)."""
        with self._timed(self._names.get(group, "other"), self.window.blocked_s):
            yield

    def add_step(self, step_s: float, data_s: float, checkpoint_s: float) -> None:
        """A step's time, and its waits for data and for a background save's copy of the state."""
        if not self.on:
            return
        self.window.steps += 1
        self.window.step_s += step_s
        self.window.data_s += data_s
        self.window.checkpoint_s += checkpoint_s

    def metering(self) -> contextlib.AbstractContextManager:
        """Around a step: its collectives' waits timed (parallel/collectives.observing), when on."""
        return observing(self) if self.on else contextlib.nullcontext()

    def part(self, name: str) -> contextlib.AbstractContextManager:
        """Time the block as the step's part `name` (parallel.stragglers.PARTS), when on."""
        return self._timed(name, self.window.parts_s) if self.on else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str, sums: dict[str, float]) -> Iterator[None]:
        """Add the block's time to sums[name]: on the host's clock on CPU; on a GPU, between two events on the
        current stream (what the device's work waited), read at the end of the window."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((sums, name, start, end))
            return
        begin = time.perf_counter()
        yield
        sums[name] += time.perf_counter() - begin

    def take(self) -> WindowFigures:
        """The window's figures (its expert rows counted up to now; its device-timed parts read, waiting for the
        last); a new window starts."""
        if self._events:
            self._events[-1][3].synchronize()
            for sums, name, start, end in self._events:
                sums[name] += start.elapsed_time(end) / 1e3
            self._events.clear()
        rows = self._rows_received()
        figures, self.window = self.window, WindowFigures()
        figures.expert_rows, self._rows_before = rows - self._rows_before, rows
        return figures

    def _rows_received(self) -> int:
        return sum(getattr(dispatcher, "rows_received", 0) for dispatcher in self._dispatchers)


FOLDED = {"ep rail": "ep", "ep node": "ep", "tp x dp": "dp"}
"""The named groups (ParallelContext.named_groups) whose blocked time GROUPS reports under a coarser name."""


def group_names(ctx: ParallelContext) -> dict[dist.ProcessGroup, str]:
    """Process group -> its name in GROUPS: the context's named groups, the finer names folded (the node
    dispatch's ep rail and ep node into ep, tp x dp into dp, each context-parallel size into cp)."""
    names: dict = {}
    for name, group in ctx.named_groups().items():
        if group is not None and group not in names:
            names[group] = FOLDED.get(name, "cp" if name.startswith("cp") else name)
    return names
