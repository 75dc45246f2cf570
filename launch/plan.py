"""Print a run's staged schedule, and its duration on a cluster from the sizing FLOPs at an assumed MFU.

    python -m launch.plan configs/full.yaml --config configs/stages/full.yaml --gpus 4096 --gpu h200

Per stage: tokens, steps, sequence length, global batch, micro-batches, learning-rate range, and with
--gpus the training FLOPs per token (which grow with the attention span) and the estimated time.
"""

import argparse
import sys

from moe_pretrain.config import EX_CONFIG, add_config_arguments, load_config_or_exit
from moe_pretrain.sizing import count
from moe_pretrain.training.schedule import plan

PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "b200": 2250.0, "a100": 312.0}
"""Dense BF16 peak per GPU, TFLOP/s (vendor figures, without sparsity)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs in the cluster (0: no time estimate)")
    parser.add_argument("--gpu", choices=sorted(PEAK_TFLOPS), default="h200")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the GPU's peak")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config_or_exit(args)
    if not cfg.stages:
        print("config error: the config has no stages section", file=sys.stderr)
        return EX_CONFIG
    peak = (args.peak_tflops or PEAK_TFLOPS[args.gpu]) * 1e12
    sizes = count(cfg.model, cfg.stages[0].seq_len)
    print(f"model: {sizes['total_params']:.4g} parameters, {sizes['active_params']:.4g} active per token")
    header = f"{'stage':8s} {'tokens':>10s} {'steps':>8s} {'seq_len':>9s} {'batch tok':>10s} {'seqs':>6s} " \
             f"{'micro':>6s} {'lr first -> last':>22s}"
    if args.gpus:
        header += f" {'TFLOP/token':>12s} {'days':>8s}"
    print(header)
    total_days = 0.0
    for row in plan(cfg):
        line = (f"{row['stage']:8s} {row['tokens']:10.4g} {row['steps']:8d} {row['seq_len']:9d} "
                f"{row['batch_tokens']:10.4g} {row['sequences']:6d} {row['micro_batches'] or 'auto':>6} "
                f"{row['lr_first']:10.3g} -> {row['lr_last']:8.3g}")
        if args.gpus:
            flops = count(cfg.model, row["seq_len"])["flops_per_token"]
            days = flops * row["tokens"] / (args.gpus * peak * args.mfu) / 86400
            total_days += days
            line += f" {flops / 1e12:12.3f} {days:8.1f}"
        print(line)
    total_tokens = sum(s.tokens for s in cfg.stages)
    summary = f"total    {total_tokens:10.4g} {cfg.train.steps:8d}"
    if args.gpus:
        summary += f"   on {args.gpus} x {args.gpu} at {args.mfu:.0%} MFU: {total_days:.1f} days"
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
