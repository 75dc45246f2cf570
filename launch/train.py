"""Pretraining entry point, one process or many:

    python -m launch.train --config configs/smoke.yaml [section.key=value ...]   (or launch.train CONFIG ...)
    torchrun --nproc-per-node 4 -m launch.train --config configs/smoke.yaml parallel.ep=2

Under torchrun every rank validates the layout before any collective, so a bad layout fails on
every rank with the same message. Exit codes (moe_pretrain/training/outcome.py): 0 finished, 75
preempted after a checkpoint (requeue me), 76 hung (watchdog), 78 permanent failure (bad config or
data, no checkpoint that verifies, repeated non-finite loss), 74 the checkpoint's file system is full,
130 interrupted by Ctrl-C after a checkpoint, 1 --require-loss-drop not met. A relaunch of a finished
run says so and exits 0. A launch refused before it becomes the run (another live run holds
train.run_dir, which rank 0 locks before anything is built; the checkpoint to resume was saved by
another model) exits 78 and leaves status.json as it was, writing run_dir/refused.json instead.
"""

import argparse
import logging
import os
import sys

import torch.distributed as dist

from kernels.fast_paths import describe as describe_fast_paths
from moe_pretrain.checkpoint import CheckpointError
from moe_pretrain.checkpoint.store import CheckpointMismatchError, StorageFullError
from moe_pretrain.config import Config, ConfigError, add_config_arguments, load_config_from_args
from moe_pretrain.data import DataError
from moe_pretrain.log import setup_logging
from moe_pretrain.training import Trainer
from moe_pretrain.training.outcome import (
    FINISHED,
    INTERRUPTED,
    PERMANENT,
    STORAGE_FULL,
    Preempted,
    write_refusal,
    write_status,
)
from moe_pretrain.training.run_lock import RunDirBusyError, RunDirLock
from moe_pretrain.training.trainer import NonFiniteError
from parallel.collectives import gather_objects
from parallel.state import ParallelContext, destroy_parallel, init_parallel

log = logging.getLogger("launch.train")

FAILURES = {StorageFullError: ("storage full", STORAGE_FULL), ConfigError: ("config error", PERMANENT),
            DataError: ("data error", PERMANENT), CheckpointError: ("checkpoint error", PERMANENT),
            NonFiniteError: ("non-finite loss", PERMANENT)}
"""Errors that end a run for good, by kind and exit code (the first class that matches)."""


def permanent_failure(err: Exception, rank: int, run_dir: str | None, trainer: Trainer | None = None) -> int:
    kind, code = next(named for cls, named in FAILURES.items() if isinstance(err, cls))
    log.error(f"{kind} (rank {rank}): {err}")
    if rank == 0 and run_dir:
        write_status(run_dir, code, trainer.step if trainer else 0, f"{kind}: {err}",
                     trainer.last_checkpoint if trainer else None)
    return code


class RunDirRefusedError(RuntimeError):
    """Rank 0 could not take train.run_dir (in use by another run, or not a directory): every rank raises it."""


def refused(err: Exception, rank: int, run_dir: str) -> int:
    """A launch that never became the run: one line, refused.json, status.json untouched."""
    log.error(f"refused (rank {rank}): {err}")
    if rank == 0:
        write_refusal(run_dir, str(err))
    return PERMANENT


def own_run_dir(cfg: Config, ctx: ParallelContext) -> RunDirLock | None:
    """Rank 0 locks train.run_dir before anything is built or resumed (run_lock.py); every rank learns the
    outcome (collective) and raises RunDirRefusedError alike. Returns rank 0's lock, to release at exit."""
    lock, failure = None, None
    if ctx.rank == 0:
        lock = RunDirLock(cfg.train.run_dir)
        try:
            lock.acquire()
        except (RunDirBusyError, ConfigError) as err:
            lock, failure = None, str(err)
    if ctx.distributed:
        failure = gather_objects(failure, dist.group.WORLD)[0]
    if failure:
        raise RunDirRefusedError(failure)
    return lock


def start_line(cfg: Config, trainer: Trainer) -> str:
    ctx = trainer.ctx
    steps = (f"{len(cfg.stages)} stages (seq_len {' -> '.join(str(s.seq_len) for s in cfg.stages)})"
             if cfg.stages else f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens")
    micro = f"{' / '.join(map(str, trainer.layout.micro_batches))} micro-batches per step"
    return (f"moe-pretrain: {sum(p.numel() for p in trainer.model.parameters()):,} parameters on rank 0, "
            f"{ctx.layout.describe()}, device {ctx.device}, {cfg.train.steps} steps of {steps}, {micro}, "
            f"dtype {cfg.train.dtype}, run dir {cfg.train.run_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe-pretrain pretraining")
    add_config_arguments(parser)
    parser.add_argument("--require-loss-drop", type=float, default=None, metavar="NATS",
                        help="exit 1 unless the mean loss of the last 10 steps is at least NATS below the first step's")
    args = parser.parse_intermixed_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        setup_logging(rank)
        cfg = load_config_from_args(args)
        setup_logging(rank, cfg.logging.level, cfg.logging.all_ranks)
        ctx = init_parallel(cfg)
    except ConfigError as err:
        return permanent_failure(err, rank, None)
    trainer, lock = None, None
    try:
        lock = own_run_dir(cfg, ctx)
        trainer = Trainer(cfg, ctx)
        log.info(start_line(cfg, trainer))
        log.info(describe_fast_paths(trainer.model))
        history = trainer.run()
    except Preempted as stop:
        log.info(f"{stop}; exiting with {stop.exit_code}" + ("" if stop.interrupted else " (requeue)"))
        if ctx.is_logging_rank:
            write_status(cfg.train.run_dir, stop.exit_code, stop.step, str(stop), stop.checkpoint)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training began (building, resuming): nothing to save yet
        step = trainer.step if trainer else 0
        log.error(f"interrupted before training started (step {step}); nothing was saved")
        if ctx.is_logging_rank:
            write_status(cfg.train.run_dir, INTERRUPTED, step, "interrupted before training started", None)
        return INTERRUPTED
    except (RunDirRefusedError, CheckpointMismatchError) as err:
        return refused(err, rank, cfg.train.run_dir)
    except tuple(FAILURES) as err:
        return permanent_failure(err, rank, cfg.train.run_dir, trainer)
    finally:
        destroy_parallel()
        if lock is not None:
            lock.release()
    if ctx.is_logging_rank:
        write_status(cfg.train.run_dir, FINISHED, trainer.step, "finished", trainer.last_checkpoint)
    if not history:  # a relaunch of a finished run: Trainer.run said so
        return FINISHED
    # One batch's loss swings with its content (stdlib files differ wildly in entropy): compare the
    # first step with the mean of the last ten.
    first = history[0]["loss"]
    tail = [h["loss"] for h in history[-10:]]
    last = sum(tail) / len(tail)
    log.info(f"first loss {first:.4f}  last loss {last:.4f} (mean of the last {len(tail)} steps; final step "
             f"{tail[-1]:.4f})  drop {first - last:.4f} nats")
    if args.require_loss_drop is not None and first - last < args.require_loss_drop:
        log.error(f"FAILED (rank {rank}): loss fell {first - last:.4f} nats, less than the required "
                  f"{args.require_loss_drop}")
        return 1
    return FINISHED


if __name__ == "__main__":
    sys.exit(main())
