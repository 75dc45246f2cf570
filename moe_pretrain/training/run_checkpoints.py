"""A run's checkpoints: where they go, the synchronous or background save, the resume, and the last committed.

Checkpoint I/O gets its own gloo groups, created collectively at start on every rank: its collectives never
interleave with training's, and their timeout grows with the largest rank's state. Background writes
(checkpoint.async_save) take a second one, apart from the training thread's polls and commits (AsyncSaver).
A failed background save stops the run or, with checkpoint.on_async_failure=continue, is reported and the
run goes on: the previous committed checkpoint stays the one to resume from.
"""

import logging
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_pretrain import checkpoint
from moe_pretrain.config import Config
from moe_pretrain.data.prefetch import BatchPrefetcher
from moe_pretrain.training.state import TrainingState
from moe_pretrain.training.step_hooks import StepHook
from parallel.collectives import all_reduce_max
from parallel.state import ParallelContext, new_host_group

log = logging.getLogger(__name__)


class RunCheckpoints:
    def __init__(self, cfg: Config, ctx: ParallelContext, state: TrainingState, batches: BatchPrefetcher):
        self.cfg, self.ctx, self.state, self.batches = cfg, ctx, state, batches
        self.root = Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")
        writes = None
        if ctx.distributed:
            timeout = self._timeout()
            state.checkpoint_group = new_host_group(timeout)
            writes = new_host_group(timeout) if cfg.checkpoint.async_save else None
        self.async_saver = checkpoint.AsyncSaver(state.checkpoint_group, writes) if cfg.checkpoint.async_save \
            else None
        self.last: Path | None = None
        """The newest committed checkpoint this run saved or resumed from."""
        self.hooks: list[StepHook] = []
        """The step hooks whose states the checkpoints keep (the trainer's, set once they are built)."""

    def _timeout(self) -> timedelta:
        largest = all_reduce_max(torch.tensor([self.state.state_bytes()], dtype=torch.float64, device=self.ctx.device),
                                 dist.group.WORLD)
        limit = checkpoint.checkpoint_timeout(self.cfg.parallel.timeout_s, int(largest.item()),
                                              self.cfg.checkpoint.io_floor_mb_s * 1e6)
        log.debug(f"checkpoint collectives time out after {limit.total_seconds():.0f} s")
        return limit

    def save(self) -> Path | None:
        """Save the state's step (synchronously, or start a background save); returns the committed directory."""
        self.state.data_position = self.batches.position
        self.state.hook_states = {hook.name: state for hook in self.hooks if (state := hook.state_dict())}
        if self.async_saver is None:
            self.last = self.state.save(self.root)
            return self.last
        c = self.cfg.checkpoint
        # The previous save, if still in flight, is committed (or its failure reported) on its own first: a
        # failure found there must not also cost this step's save (on_async_failure=continue).
        self.wait()
        # Snapshots only: an async save writes this JSON at commit time, steps later.
        self._guard(self.async_saver.start, self.root, self.state.step, *self.state.snapshot(), c.keep_last,
                    c.keep_every)
        return None

    def poll(self) -> None:
        """Commit a background save that has finished writing (between steps)."""
        if self.async_saver is not None:
            self.last = self._guard(self.async_saver.poll) or self.last

    def wait(self) -> None:
        """Commit the background save in flight, if any."""
        if self.async_saver is not None:
            self.last = self._guard(self.async_saver.wait) or self.last

    def _guard(self, operation, *args):
        try:
            return operation(*args)
        except checkpoint.CheckpointError as err:
            if self.cfg.checkpoint.on_async_failure == "stop":
                raise
            if self.ctx.is_logging_rank:
                log.error(f"checkpoint: background save failed, training continues: {err}")
            return None

    def resume(self) -> Path | None:
        """Load the checkpoint train.resume asks for (every rank verifies its share of the files while the
        load reads them; all agree)."""
        verifier = checkpoint.verifying_load(self.state.load, self.state.checkpoint_group)
        path, _ = checkpoint.find(self.root, self.cfg.train.resume, verifier,  # find() logs what it skips
                                  check_fit=self.state.check_fit, set_aside=True)
        if path is None:
            return None
        if self.state.data_position:  # a model-only checkpoint (imported weights) starts the data afresh
            self.batches.load_state(self.state.data_position)
        for hook in self.hooks:
            if hook.name in self.state.hook_states:
                hook.load_state_dict(self.state.hook_states[hook.name])
        self.state.restore_rng()
        log.info(f"checkpoint: resumed from {path} at step {self.state.step}")
        self.last = Path(path)
        return self.last
