"""Pretraining entry point: `python -m launch.train --config configs/smoke.yaml [section.key=value ...]`."""

import argparse
import sys

from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.training import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe-pretrain pretraining")
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="overrides such as train.steps=20 model.moe.num_experts=8")
    parser.add_argument("--require-loss-drop", type=float, default=None, metavar="NATS",
                        help="exit 1 unless the mean loss of the last 10 steps is at least NATS below the first step's")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg)
        print(f"moe-pretrain: {sum(p.numel() for p in trainer.model.parameters()):,} parameters, "
              f"{cfg.train.steps} steps of {cfg.data.batch_size} x {cfg.data.seq_len} tokens, "
              f"dtype {cfg.train.dtype}, run dir {cfg.train.run_dir}", flush=True)
        history = trainer.run()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    # One batch's loss swings with its content (stdlib files differ wildly in entropy): compare the
    # first step with the mean of the last ten.
    first = history[0]["loss"]
    tail = [h["loss"] for h in history[-10:]]
    last = sum(tail) / len(tail)
    print(f"first loss {first:.4f}  last loss {last:.4f} (mean of the last {len(tail)} steps; final step "
          f"{tail[-1]:.4f})  drop {first - last:.4f} nats")
    if args.require_loss_drop is not None and first - last < args.require_loss_drop:
        print(f"FAILED: loss fell {first - last:.4f} nats, less than the required {args.require_loss_drop}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
