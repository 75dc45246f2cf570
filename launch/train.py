"""Pretraining entry point, one process or many:

    python -m launch.train --config configs/smoke.yaml [section.key=value ...]
    torchrun --nproc-per-node 4 -m launch.train --config configs/smoke.yaml parallel.ep=2

Under torchrun every rank validates the layout before any collective, so a bad layout fails on
every rank with the same message. Exit codes (moe_pretrain/training/outcome.py): 0 finished, 75
preempted after a checkpoint (requeue me), 76 hung (watchdog), 78 permanent failure (bad config or
data, no checkpoint that verifies, repeated non-finite loss), 1 --require-loss-drop not met.
"""

import argparse
import os
import sys

from moe_pretrain.checkpoint import CheckpointError
from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.data import DataError
from moe_pretrain.training import Trainer
from moe_pretrain.training.outcome import FINISHED, PERMANENT, REQUEUE, Preempted, write_status
from moe_pretrain.training.trainer import NonFiniteError
from parallel.state import destroy_parallel, init_parallel

PERMANENT_ERRORS = {ConfigError: "config error", DataError: "data error", CheckpointError: "checkpoint error",
                    NonFiniteError: "non-finite loss"}


def permanent_failure(err: Exception, rank: str, run_dir: str | None, step: int = 0) -> int:
    kind = next(name for cls, name in PERMANENT_ERRORS.items() if isinstance(err, cls))
    print(f"{kind} (rank {rank}): {err}", file=sys.stderr, flush=True)
    if rank == "0" and run_dir:
        write_status(run_dir, PERMANENT, step, f"{kind}: {err}", None)
    return PERMANENT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe-pretrain pretraining")
    parser.add_argument("--config", required=True, action="append",
                        help="YAML config file; repeat to layer files (later ones win), e.g. a model and a schedule")
    parser.add_argument("overrides", nargs="*", help="overrides such as train.steps=20 model.moe.num_experts=8")
    parser.add_argument("--require-loss-drop", type=float, default=None, metavar="NATS",
                        help="exit 1 unless the mean loss of the last 10 steps is at least NATS below the first step's")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        cfg = load_config(args.config, args.overrides)
        ctx = init_parallel(cfg)
    except ConfigError as err:
        return permanent_failure(err, rank, None)
    trainer = None
    try:
        trainer = Trainer(cfg, ctx)
        if ctx.is_logging_rank:
            steps = (f"{len(cfg.stages)} stages (seq_len {' -> '.join(str(s.seq_len) for s in cfg.stages)})"
                     if cfg.stages else f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens")
            print(f"moe-pretrain: {sum(p.numel() for p in trainer.model.parameters()):,} parameters on rank 0, "
                  f"{ctx.layout.describe()}, {cfg.train.steps} steps of {steps}, dtype {cfg.train.dtype}, "
                  f"run dir {cfg.train.run_dir}", flush=True)
        history = trainer.run()
    except Preempted as stop:
        if ctx.is_logging_rank:
            print(f"{stop}; exiting with {REQUEUE} (requeue)", flush=True)
            write_status(cfg.train.run_dir, REQUEUE, stop.step, str(stop), stop.checkpoint)
        return REQUEUE
    except tuple(PERMANENT_ERRORS) as err:
        return permanent_failure(err, rank, cfg.train.run_dir, trainer.step if trainer else 0)
    finally:
        destroy_parallel()
    if ctx.is_logging_rank:
        write_status(cfg.train.run_dir, FINISHED, trainer.step, "finished", trainer.last_checkpoint)
    # One batch's loss swings with its content (stdlib files differ wildly in entropy): compare the
    # first step with the mean of the last ten.
    first = history[0]["loss"]
    tail = [h["loss"] for h in history[-10:]]
    last = sum(tail) / len(tail)
    if ctx.is_logging_rank:
        print(f"first loss {first:.4f}  last loss {last:.4f} (mean of the last {len(tail)} steps; final step "
              f"{tail[-1]:.4f})  drop {first - last:.4f} nats")
    if args.require_loss_drop is not None and first - last < args.require_loss_drop:
        print(f"FAILED (rank {rank}): loss fell {first - last:.4f} nats, less than the required "
              f"{args.require_loss_drop}", file=sys.stderr)
        return 1
    return FINISHED


if __name__ == "__main__":
    sys.exit(main())
