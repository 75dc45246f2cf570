"""Per-Head Muon's optimizer step against AdamW's, at 1, 2 and 4 processes: time, and bytes against the plan.

Run: .venv/bin/python bench/muon.py [--steps 5]

The smoke model with 64 experts (so that the routed experts, Muon's batched matrices, are most of the
parameters). For each layout both optimizers run the same steps; the optimizer update (clip, the step, the
parameters' all-gather) is timed around ShardedOptimizer.update, median over the steps after the first,
and Muon's is printed as a ratio to AdamW's measured in the same invocation. "sent" is what rank 0's two
all-to-alls send per step (from their static splits) next to planning/rank_state.py's figure for the stage,
and "NS" the plan's Newton-Schulz GFLOP per rank and step. On a 2-core machine 4 processes oversubscribe the
cores: the times there show overhead, not a cluster's speed.
"""

import argparse
import statistics
import tempfile
import time

import torch

from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.planning.rank_state import per_rank_bytes
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel

MODEL = ["model.moe.num_experts=64"]


def measure(rank: int, world_size: int, steps: int, overrides: list[str]) -> tuple[float, int]:
    """(median seconds of the optimizer update, bytes rank 0's Muon exchange sends per step)."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("configs/smoke.yaml", [f"train.steps={steps}", "logging.progress=false", "eval.tokens=0",
                                                 "eval.every=0", f"train.run_dir={run_dir}", *MODEL, *overrides])
        ctx = init_parallel(cfg)
        try:
            trainer = Trainer(cfg, ctx)
            optimizer, seconds = trainer.optimizer, []
            update = optimizer.update

            def timed(*args, **kwargs):
                start = time.perf_counter()
                update(*args, **kwargs)
                optimizer.finish_parameter_gathers()
                seconds.append(time.perf_counter() - start)

            optimizer.update = timed
            run_training(trainer)
            sent = optimizer.exchange_bytes()
        finally:
            destroy_parallel()
    return statistics.median(seconds[1:]), sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    layouts = [("1 process", 1, "dp=1", []), ("dp 2", 2, "dp=2", []), ("dp 2, ep 2", 2, "dp=2,ep=2", ["parallel.ep=2"]),
               ("tp 2", 2, "tp=2", ["parallel.tp=2"]), ("dp 4, ep 2", 4, "dp=4,ep=2", ["parallel.ep=2"]),
               ("tp 2, dp 2, ep 2", 4, "tp=2,dp=2,ep=2", ["parallel.tp=2", "parallel.ep=2"])]
    print(f"smoke model with 64 experts, {args.steps} steps, {torch.get_num_threads()} cores; optimizer update, "
          f"median ms")
    for name, world, plan_layout, overrides in layouts:
        row = {}
        for optimizer in ("adamw", "muon"):
            run = [*overrides, f"optim.name={optimizer}"]
            row[optimizer] = measure(0, 1, args.steps, run) if world == 1 else run_distributed(
                measure, world, args.steps, run, timeout=900)
        cfg = load_config("configs/smoke.yaml", [*MODEL, "optim.name=muon", *overrides])
        planned = per_rank_bytes(cfg, plan_layout)["stages"][0]
        (adamw, _), (muon, sent) = row["adamw"], row["muon"]
        print(f"  {name:18s} AdamW {adamw * 1e3:7.1f}  Muon {muon * 1e3:7.1f} ({muon / adamw:5.2f}x AdamW)  "
              f"sent {sent / 1e6:6.2f} MB (plan {planned['muon_exchange_bytes'] / 1e6:6.2f})  "
              f"NS {planned['muon_flops'] / 1e9:6.2f} GFLOP")


if __name__ == "__main__":
    main()
