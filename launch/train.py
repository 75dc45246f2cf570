"""Pretraining entry point, one process or many:

    python -m launch.train --config configs/smoke.yaml [section.key=value ...]   (or launch.train CONFIG ...)
    torchrun --nproc-per-node 4 -m launch.train --config configs/smoke.yaml parallel.ep=2

Under torchrun every rank validates the layout before any collective, so a bad layout fails on every rank with the
same message. Exit codes (moe_pretrain/operations/outcome.py): 0 finished, 75 preempted after a checkpoint (requeue
me), 76 hung (watchdog), 78 permanent failure (bad config or data, no checkpoint that verifies, repeated non-finite
loss), 74 the checkpoint's file system is full, 77 a rank was lost (its process or node died: the remaining ranks
name it), 130 interrupted by Ctrl-C after a checkpoint, 1 --require-loss-drop not met. A relaunch of a finished run
says so and exits 0. A worker torchrun restarts in place after its launch's run ended with 75, 78, 74 or 130 exits
at once with the same code (outcome.py says why). A launch refused before it becomes the run (another live run
holds train.run_dir, which rank 0 locks before anything is built; the checkpoint to resume was saved by another
model) exits 78 and leaves status.json as it was, writing run_dir/refused.json instead. The config is read and
checked before torch is imported, so a config error is reported in well under two seconds.
"""

import argparse
import logging
import os
import sys

from moe_pretrain.config import EX_CONFIG, ConfigError, add_config_arguments, load_config_from_args
from moe_pretrain.log import setup_logging
from moe_pretrain.operations.outcome import ended_before_restart

log = logging.getLogger("launch.train")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description="moe-pretrain pretraining")
    add_config_arguments(parser)
    parser.add_argument("--require-loss-drop", type=float, default=None, metavar="NATS",
                        help="exit 1 unless the mean loss of the run's last 10 steps is at least NATS below its "
                             "first step's (from metrics.jsonl: across resumes)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        setup_logging(rank)
        cfg = load_config_from_args(args)
        setup_logging(rank, cfg.logging.level, cfg.logging.all_ranks)
    except ConfigError as err:
        log.error(f"config error (rank {rank}): {err}")
        return EX_CONFIG
    if ended := ended_before_restart(cfg.train.run_dir):
        log.error(f"not restarted (rank {rank}): {ended[1]}")
        return ended[0]
    from launch.training_run import train  # torch, megatron-core: imported only for a config that holds

    return train(cfg, rank, args.require_loss_drop)


if __name__ == "__main__":
    sys.exit(main())
