"""Training throughput of the smoke model at 1, 2 and 4 processes, data and expert parallel.

Run: .venv/bin/python bench/scaling.py [--steps 6]

Same global batch (8 x 256 tokens) for every layout; tokens/s is the median over the steps after
the first, and each layout is printed as a ratio to the 1-process run measured in the same
invocation. On a 2-core machine 4 processes oversubscribe the cores: the ratios there show the
communication and scheduling overhead of the layout, not the speed-up a cluster would see.
"""

import argparse
import statistics
import tempfile

import torch

from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel


def throughput(rank: int, world_size: int, steps: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("configs/smoke.yaml", [f"train.steps={steps}", "logging.progress=false", "eval.tokens=0",
                                                 "eval.every=0", f"train.run_dir={run_dir}", *overrides])
        ctx = init_parallel(cfg)
        try:
            history = run_training(Trainer(cfg, ctx))
        finally:
            destroy_parallel()
    return statistics.median(h["tokens_per_s"] for h in history[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    layouts = [("1 process", 1, []), ("dp 2", 2, []), ("dp 2, ep 2", 2, ["parallel.ep=2"]),
               ("tp 2", 2, ["parallel.tp=2"]), ("tp 2, ep 2", 2, ["parallel.tp=2", "parallel.ep=2"]),
               ("pp 2 (1F1B, 2 mb)", 2, ["parallel.pp=2", "data.micro_batches=2"]),
               ("dp 4", 4, []), ("dp 4, ep 4", 4, ["parallel.ep=4"]),
               ("tp 2, dp 2, ep 2", 4, ["parallel.tp=2", "parallel.ep=2"]),
               ("pp 2, tp 2, ep 2", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "data.micro_batches=2"])]
    print(f"smoke model, global batch 8 x 256 tokens, {args.steps} steps, {cores} cores")
    base = None
    for name, world, overrides in layouts:
        if world == 1:
            rate = throughput(0, 1, args.steps, overrides)
        else:
            rate = run_distributed(throughput, world, args.steps, overrides, timeout=600)
        base = base or rate
        print(f"  {name:18s} {rate:9,.0f} tokens/s  ({rate / base:.2f}x 1 process)")


if __name__ == "__main__":
    main()
