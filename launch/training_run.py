"""One training run once its config holds: the parallel groups, the run directory's lock, the trainer, and
how the run ends (exit code, status.json or refused.json). launch/train.py reads the config first and imports
this module only then, so that a config error is reported before torch and megatron-core are imported."""

import json
import logging
import signal
import socket
from pathlib import Path

import torch.distributed as dist

from gpu_kernels.fast_paths import describe as describe_fast_paths
from moe_pretrain.checkpoint import CheckpointError
from moe_pretrain.checkpoint.store import CheckpointMismatchError, StorageFullError
from moe_pretrain.config import Config, ConfigError
from moe_pretrain.data import DataError
from moe_pretrain.operations.outcome import (
    FINISHED,
    INTERRUPTED,
    LOST_PEER,
    PERMANENT,
    STORAGE_FULL,
    Preempted,
    write_refusal,
    write_status,
)
from moe_pretrain.operations.run_lock import RunDirBusyError, RunDirLock
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.operations.wandb_run import check_wandb
from moe_pretrain.training import Trainer
from moe_pretrain.training.trainer import NonFiniteError
from moe_pretrain.writable import write_problem
from parallel.collectives import gather_objects
from parallel.lost_peers import lost_a_peer, lost_line, register
from parallel.state import ParallelContext, destroy_parallel, init_parallel

log = logging.getLogger("launch.train")  # the entry point's logger: its lines read as launch.train's

FAILURES = {StorageFullError: ("storage full", STORAGE_FULL), ConfigError: ("config error", PERMANENT),
            DataError: ("data error", PERMANENT), CheckpointError: ("checkpoint error", PERMANENT),
            NonFiniteError: ("non-finite loss", PERMANENT)}
"""Errors that end a run for good, by kind and exit code (the first class that matches)."""


def permanent_failure(err: Exception, rank: int, run_dir: str | None, trainer: Trainer | None = None) -> int:
    kind, code = next(named for cls, named in FAILURES.items() if isinstance(err, cls))
    log.error(f"{kind} (rank {rank}): {err}")
    if rank == 0 and run_dir:
        write_status(run_dir, code, trainer.step if trainer else 0, f"{kind}: {err}",
                     trainer.checkpoints.last if trainer else None)
    return code


class RunDirRefusedError(RuntimeError):
    """Rank 0 could not take train.run_dir (in use by another run, or not a directory): every rank raises it."""


def lost_peer(err: BaseException, ctx: ParallelContext, trainer: Trainer | None, run_dir: str) -> int:
    """A collective failed because a rank is gone: one line naming it (parallel/lost_peers.py), status lost_peer.
    torchrun sends the remaining workers of the lost rank's node SIGTERM at once, after the training loop has
    given its handlers back: it is ignored while the ranks meet, lest it end them before they say who is gone."""
    step = trainer.step if trainer else 0
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        line = lost_line(err, ctx.store, ctx.rank, dist.get_world_size(), step)
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.error(f"lost peer (rank {ctx.rank}): {line}")
    if ctx.rank == 0:
        write_status(run_dir, LOST_PEER, step, f"lost peer: {line}", trainer.checkpoints.last if trainer else None)
    return LOST_PEER


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


def check_output_directories(cfg: Config, ctx: ParallelContext) -> None:
    """Every directory the run writes to takes a write on every rank, before anything is built (writable.py):
    train.run_dir (every rank's hang dumps, rank 0's status, metrics and logs) and checkpoint.dir (every rank's
    shards), so an unwritable checkpoint directory is found now, not at the first save. Raises the same
    ConfigError on every rank, naming the key, the path and the first rank and host it failed on (exit 78)."""
    directories = {"train.run_dir": Path(cfg.train.run_dir),
                   "checkpoint.dir": Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")}
    problem = next((f"{key}={path} {why} (rank {ctx.rank} on {socket.gethostname()})"
                    for key, path in directories.items() if (why := write_problem(path))), None)
    if ctx.distributed:
        problem = next((p for p in gather_objects(problem, dist.group.WORLD) if p), None)
    if problem:
        raise ConfigError(problem)


def start_line(cfg: Config, trainer: Trainer) -> str:
    ctx = trainer.ctx
    steps = (f"{len(cfg.stages)} stages (seq_len {' -> '.join(str(s.seq_len) for s in cfg.stages)})"
             if cfg.stages else f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens")
    micro = f"{' / '.join(str(stage.micro_batches) for stage in trainer.layout.stages)} micro-batches per step"
    return (f"moe-pretrain: {sum(p.numel() for p in trainer.model.parameters()):,} parameters on rank 0, "
            f"{ctx.layout.describe()}, device {ctx.device}, {cfg.train.steps} steps of {steps}, {micro}, "
            f"dtype {cfg.train.dtype}, run dir {cfg.train.run_dir}")


def run_first_loss(run_dir: Path, first_here: dict) -> tuple[float, int]:
    """(loss, step) of the run's first step: metrics.jsonl's first record, which a resumed run appended to;
    this process's first record when that file is not readable here (another node's run directory)."""
    try:
        with (run_dir / "metrics.jsonl").open() as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        first = None
    record = first if isinstance(first, dict) and first.get("step", 1e18) <= first_here["step"] else first_here
    return record["loss"], record["step"]


def train(cfg: Config, rank: int, require_loss_drop: float | None = None) -> int:
    """Train per cfg on this process's rank; the exit code (launch/train.py's docstring lists them)."""
    try:
        ctx = init_parallel(cfg)
    except ConfigError as err:
        return permanent_failure(err, rank, None)
    trainer, lock = None, None
    register(ctx.store, ctx.rank)
    try:
        lock = own_run_dir(cfg, ctx)
        check_output_directories(cfg, ctx)
        check_wandb(cfg)  # before the model is built
        trainer = Trainer(cfg, ctx)
        log.info(start_line(cfg, trainer))
        log.info(describe_fast_paths(trainer.model))
        history = run_training(trainer)
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
    except RuntimeError as err:
        if not (ctx.distributed and lost_a_peer(err)):
            raise
        return lost_peer(err, ctx, trainer, cfg.train.run_dir)
    finally:
        destroy_parallel()
        if lock is not None:
            lock.release()
    if ctx.is_logging_rank:
        write_status(cfg.train.run_dir, FINISHED, trainer.step, "finished", trainer.checkpoints.last)
    if not history:  # a relaunch of a finished run: run_training said so
        return FINISHED
    # One batch's loss swings with its content (stdlib files differ wildly in entropy): compare the
    # run's first step (before any resume) with the mean of the last ten.
    first, first_step = run_first_loss(Path(cfg.train.run_dir), history[0])
    tail = [h["loss"] for h in history[-10:]]
    last = sum(tail) / len(tail)
    log.info(f"first loss {first:.4f} (step {first_step})  last loss {last:.4f} (mean of the last {len(tail)} "
             f"steps; final step {tail[-1]:.4f})  drop {first - last:.4f} nats")
    if require_loss_drop is not None and first - last < require_loss_drop:
        log.error(f"FAILED (rank {rank}): loss fell {first - last:.4f} nats, less than the required "
                  f"{require_loss_drop}")
        return 1
    return FINISHED

