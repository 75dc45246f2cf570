"""The plan against the code: launch.plan's per-GPU memory, communication and FLOPs beside what the dry run
(launch/dryrun.py) counts for each stage's rank roles, with the ratio, the predicted step time and MFU,
and how long each dry run took here.

Run: .venv/bin/python bench/dry_run.py [--config configs/full.yaml --config configs/stages/full.yaml]
         [--gpus 2048] [--stage 8k ...] [--micro-batches 4] [--gpu h200] [--traces DIR]
Defaults: the full-size model and schedule at 2048 GPUs, each stage's first step cut to parallel.pp
micro-batches (a 1F1B pipeline's peak is set in its warm-up; the plan is computed for the same cut step),
one rank per pipeline role. A full-width rank takes tens of CPU minutes per stage here; the smoke model
(--config configs/smoke.yaml --config configs/stages/tiny.yaml parallel.tp=2 parallel.pp=2 parallel.ep=2
train.dtype=bfloat16 --gpus 4) takes seconds. Ratios are traced / plan; the plan's memory is live tensor
bytes' counterpart (allocator slack, NCCL buffers and the CUDA context are in neither).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_pretrain.config import add_config_arguments, load_config_or_exit
from moe_pretrain.planning.plan_vs_dry_run import HEADER, comparison_lines, plan_of_traced_step
from moe_pretrain.planning.stage_memory import RunLayout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, default=2048)
    parser.add_argument("--stage", action="append", default=[], help="stage names (default: every stage)")
    parser.add_argument("--micro-batches", type=int, default=0, help="default: parallel.pp")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="keep each stage's dry run in DIR/<stage>.json and reuse one found there (the plan is "
                             "computed afresh: to check a change of the plan against the code without tracing again)")
    args = parser.parse_intermixed_args()
    if not args.config and not args.config_items:
        args.config = ["configs/full.yaml", "configs/stages/full.yaml"]
    cfg = load_config_or_exit(args)
    names = args.stage or [s.name for s in cfg.stages]
    micro = args.micro_batches or cfg.parallel.pp
    files = [item for item in args.config_items if "=" not in item] + args.config
    overrides = [item for item in args.config_items if "=" in item]
    p = cfg.parallel
    run = RunLayout(args.gpus, p.tp, p.pp, p.ep, p.vpp)
    print(f"plan vs dry run at {args.gpus} x {args.gpu}, {run.describe()}, each stage's first {micro} "
          f"micro-batches; ratios traced / plan")
    print(HEADER)
    for name in names:
        index = [s.name for s in cfg.stages].index(name)
        with tempfile.TemporaryDirectory() as tmp:
            out = (args.traces or Path(tmp)) / f"{name}.json"
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "launch.dryrun", *(f"--config={f}" for f in files),
                                *overrides, "data.prefetch=false", "--gpus", str(args.gpus), "--stage", name,
                                "--micro-batches", str(micro), "--gpu", args.gpu, "--json", str(out)],
                               check=True, stdout=subprocess.DEVNULL)
            traces = json.loads(out.read_text())
        planned, pricing = plan_of_traced_step(cfg, run, index, micro,
                                               [(trace["cp_rank"], trace["dp_rank"]) for trace in traces])
        print("\n".join(comparison_lines(name, planned, traces)))
        print(f"  ({pricing})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
