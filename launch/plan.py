"""Print a run's staged schedule, its duration, and its per-GPU memory and communication per stage.

    python -m launch.plan --config configs/full.yaml --config configs/stages/full.yaml --gpus 4096 --gpu h200
    python -m launch.plan --config configs/full.yaml --config configs/stages/full.yaml --gpus 4096 --propose

Per stage: tokens, steps, sequence length, global batch, micro-batches, learning-rate range, and with
--gpus the training FLOPs per token (which grow with the attention span); then the memory plan
(moe_pretrain/planning/stage_memory.py) of the config's layout (parallel.* and each stage's cp, recompute and
micro-batches): the worst pipeline rank's GB per GPU, flagged when it does not fit, and the bytes each GPU
sends per step per group; then each stage's step time, MFU and days from the plan's step-time model
(planning/plan_step_time.py: no assumed MFU). --traces DIR sets the dry run's figures (launch.dryrun, kept
by bench/dry_run.py --traces DIR) beside the plan's, and takes its step time too. --propose searches layouts
and prints the smallest that fits every stage with 10% headroom.
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from moe_pretrain.config import EX_CONFIG, add_config_arguments, load_config_or_exit
from moe_pretrain.model.counts import count, total_parts
from moe_pretrain.planning.collective_traffic import PLAN_COLUMNS, plan_columns
from moe_pretrain.planning.fastest_layouts import fastest_layouts
from moe_pretrain.planning.plan_step_time import (
    TRACE_KEYS,
    column_links,
    plan_groups,
    planned_step,
    traced_stage_step,
)
from moe_pretrain.planning.plan_vs_dry_run import HEADER, comparison_lines, plan_of_traced_step
from moe_pretrain.planning.stage_memory import (
    GPU_BYTES,
    HEADROOM,
    MemoryPlanner,
    RunLayout,
    gigabytes,
    stage_layouts_of,
    within,
)
from moe_pretrain.planning.step_time import GPUS, GpuSpec
from moe_pretrain.training.schedule import plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs in the cluster (0: no time estimate)")
    parser.add_argument("--gpu", choices=sorted(GPU_BYTES), default="h200")  # memory and peak both known
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the GPU's peak")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="dry-run traces, DIR/<stage>.json (bench/dry_run.py --traces DIR): print them beside "
                             "the plan and give the days at their step time as well")
    parser.add_argument("--gpu-gb", type=float, default=0.0, help="override the GPU's memory (GB, 1e9 bytes)")
    parser.add_argument("--propose", action="store_true",
                        help="search the smallest layout that fits each stage, and the three fastest that fit them all")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config_or_exit(args)
    if not cfg.stages:
        print("config error: the config has no stages section", file=sys.stderr)
        return EX_CONFIG
    sizes = count(cfg.model, cfg.stages[0].seq_len)
    print(f"model: {sizes['total_params']:.4g} parameters ({total_parts(cfg.model, cfg.stages[0].seq_len)}), "
          f"{sizes['active_params']:.4g} active per token")
    header = f"{'stage':8s} {'tokens':>10s} {'steps':>8s} {'seq_len':>9s} {'batch tok':>10s} {'seqs':>6s} " \
             f"{'micro':>6s} {'lr first -> last':>22s}"
    print(header + (f" {'TFLOP/token':>12s}" if args.gpus else ""))
    for row in plan(cfg):
        line = (f"{row['stage']:8s} {row['tokens']:10.4g} {row['steps']:8d} {row['seq_len']:9d} "
                f"{row['batch_tokens']:10.4g} {row['sequences']:6d} {row['micro_batches'] or 'auto':>6} "
                f"{row['lr_first']:10.3g} -> {row['lr_last']:8.3g}")
        if args.gpus:
            line += f" {count(cfg.model, row['seq_len'])['flops_per_token'] / 1e12:12.3f}"
        print(line)
    print(f"total    {sum(s.tokens for s in cfg.stages):10.4g} {cfg.train.steps:8d}")
    if not args.gpus:
        return 0
    code, planned = print_memory_plan(cfg, args.gpus, args.gpu, args.propose, args.gpu_gb * 1e9)
    gpu = GPUS[args.gpu]
    if args.peak_tflops:
        gpu = dataclasses.replace(gpu, peak_flops=args.peak_tflops * 1e12)
    print_step_times(cfg, args.gpus, planned, gpu, args.traces)
    if args.propose:
        print_fastest(cfg, args.gpus, args.gpu_gb * 1e9 or GPU_BYTES[args.gpu], gpu)
    return code


def print_fastest(cfg, gpus: int, capacity: float, gpu: GpuSpec) -> None:
    """The three run layouts on which every stage fits, fewest planned days first, each stage at its fastest
    fitting layout (planning/fastest_layouts.py)."""
    ranked = fastest_layouts(cfg, gpus, capacity, gpu)
    print(f"\nfastest layouts that fit every stage with {HEADROOM:.0%} headroom, by the plan's step time (FLOPs at "
          f"the peak, the all-to-all counted whole): trace the first two with the dry run before taking one")
    if not ranked:
        print(f"none: no run layout of {gpus} GPUs fits every stage")
    for place, layout in enumerate(ranked, start=1):
        print(f"{place}. {layout.run.describe()}: {layout.days:.4g} days")
        for stage, (stage_layout, step) in zip(cfg.stages, layout.stages, strict=True):
            print(f"   {stage.name:8s} {stage_layout.describe():29s} step {step.step_s:9.4g} s  MFU {step.mfu:6.1%} "
                  f"{step.days:9.4g} days")


def print_memory_plan(cfg, gpus: int, gpu: str, propose: bool, capacity: float = 0.0) -> tuple[int, dict]:
    """The memory plan of the config's layout (and with propose, the proposed one's): the exit code, and each
    valid stage's plan on the config's layout by name (MemoryPlanner.stage)."""
    planner = MemoryPlanner(cfg)
    capacity = capacity or GPU_BYTES[gpu]
    p = cfg.parallel
    run = RunLayout(gpus, p.tp, p.pp, p.ep, p.vpp)
    layouts = stage_layouts_of(cfg)
    print(f"\nmemory per GPU, GB, worst pipeline rank ({gpu}: {capacity / 1e9:.3g} GB), layout {run.describe()}")
    all_fit, planned = print_stages(planner, run, layouts, capacity)
    if propose:
        found = planner.propose(gpus, capacity)
        if found is None:
            print(f"\nno layout of {gpus} GPUs fits any stage with {HEADROOM:.0%} headroom")
            return 1, planned
        run, stages = found
        print(f"\nproposed: {run.describe()} (fits the most stages with {HEADROOM:.0%} headroom, then the least "
              "tp x pp; per stage the least cp, then the cheapest recomputation)")
        print_stages(planner, run, [s[0] if s else None for s in stages], capacity)
        unfit = [stage.name for stage, s in zip(cfg.stages, stages, strict=True) if s is None]
        if unfit:
            print(f"no layout of {gpus} GPUs with {run.describe()} fits: {', '.join(unfit)}")
            return 1, planned
        return 0, planned
    return 0 if all_fit else 1, planned


def print_stages(planner: MemoryPlanner, run: RunLayout, layouts, capacity: float) -> tuple[bool, dict]:
    """Whether every stage fits, and each valid stage's plan by name."""
    columns = ("params", "grads", "optim", "copies", "mixers", "activ", "a2a", "qb", "vision", "total", "host")
    print(f"{'stage':8s} {'layout':29s} {'dp':>5s} " + " ".join(f"{c:>7s}" for c in columns) + f" {'fits':>5s} | "
          f"GB sent/step: "
          f"{'tp':>6s} {'ep':>6s} {'pp':>6s} {'cp':>6s} {'dp':>6s} | {'NVLink':>6s} {'NIC':>6s}")
    all_fit, planned = True, {}
    for stage, layout in zip(planner.cfg.stages, layouts, strict=True):
        if layout is None:
            all_fit = False
            print(f"{stage.name:8s} {'-':29s} no layout fits (see below)")
            continue
        problems = planner.problems(run, stage, layout)
        if problems:
            all_fit = False
            print(f"{stage.name:8s} {layout.describe():29s} invalid: {'; '.join(problems)}")
            continue
        result = planned[stage.name] = planner.stage(run, stage, layout)
        w, c = result["worst"], plan_columns(result["communication"])
        nvlink, nic = column_links(result["communication"], plan_groups(planner.cfg, run, layout.cp),
                                   planner.cfg.cluster)
        fits = within(result, capacity)
        all_fit &= fits
        sizes = [w[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "compute_copy_bytes",
                                "mixer_state_bytes", "activation_bytes", "buffer_bytes", "balancing_bytes")]
        sizes += [result["first"]["vision_bytes"], w["total_bytes"], result["host_bytes"]]
        print(f"{stage.name:8s} {layout.describe():29s} {result['dp']:5d} " + " ".join(map(gigabytes, sizes))
              + f" {'yes' if fits else 'NO':>5s} |               "
              + " ".join(gigabytes(c[k])[1:] for k in PLAN_COLUMNS) + " | "
              + " ".join(gigabytes(x)[1:] for x in (nvlink, nic)))
        if w["muon_flops"]:
            print(f"{'':8s} Muon: {w['muon_flops'] / 1e12:.1f} TFLOP of Newton-Schulz per GPU and step (in the step's "
                  f"FLOPs), its exchange in dp's column and its tp slices' joins in tp's; its step holds "
                  f"{w['muon_step_bytes'] / 1e9:.1f} GB after the activations are freed")
    return all_fit, planned


def print_step_times(cfg, gpus: int, planned: dict, gpu: GpuSpec, traces: Path | None) -> None:
    """Each stage's step time, MFU and days on the config's layout: the plan's model (on planned, each valid
    stage's plan by name), and with traces the dry run's (its predicted rank times scaled to the stage's
    micro-batches, with the same bubble)."""
    p = cfg.parallel
    run = RunLayout(gpus, p.tp, p.pp, p.ep, p.vpp)
    print(f"\nstep time on {gpus} x {gpu.name} ({gpu.peak_flops / 1e12:.0f} TFLOP/s dense peak), layout "
          f"{run.describe()}: the plan's FLOPs at the peak (a bound: memory-bound ops are the dry run's to count), "
          f"its communication on the links it crosses, the 1F1B bubble; MFU counts MLA's attention at one document "
          f"per row in the plan's columns, at the documents the traced step ran in the dry run's")
    print(f"{'stage':8s} {'step s':>8s} {'MFU':>6s} {'days':>7s}" + (f" | dry run: {'step s':>8s} {'MFU':>6s} "
                                                                       f"{'days':>7s}" if traces else ""))
    days = {"plan": 0.0, "dry run": 0.0}
    traced_stages = []
    for index, (stage, layout) in enumerate(zip(cfg.stages, stage_layouts_of(cfg), strict=True)):
        if stage.name not in planned:
            print(f"{stage.name:8s} {'-':>8s} (no valid layout)")
            continue
        step = planned_step(cfg, run, stage, layout, planned[stage.name]["ranks"], gpu, cfg.cluster)
        days["plan"] += step.days
        line = f"{stage.name:8s} {step.step_s:8.2f} {step.mfu:6.1%} {step.days:7.1f}"
        found = traces / f"{stage.name}.json" if traces else None
        if found and found.exists():
            traced = json.loads(found.read_text())
            if missing := TRACE_KEYS - set(traced[0]):
                print(f"{found}: a trace without {', '.join(sorted(missing))} (made by an older dry run): trace "
                      f"the stage again (bench/dry_run.py --stage {stage.name} --traces {traces})", file=sys.stderr)
                sys.exit(os.EX_DATAERR)
            dry = traced_stage_step(cfg, run, stage, layout, traced, gpu)
            days["dry run"] += dry.days
            traced_stages.append((index, traced))
            line += f" |          {dry.step_s:8.2f} {dry.mfu:6.1%} {dry.days:7.1f}"
        print(line)
    summary = f"total days: {days['plan']:.1f} (plan)"
    if traced_stages:
        names = ", ".join(cfg.stages[i].name for i, _ in traced_stages)
        summary += f", {days['dry run']:.1f} (dry run, stages {names})"
    print(summary)
    if traced_stages:
        print("\nthe plan beside the dry run (ratios traced / plan; the plan of the traced step's micro-batches)")
        print(HEADER)
        for index, traced in traced_stages:
            ranks, pricing = plan_of_traced_step(cfg, run, index, traced[0]["micro_batches"],
                                                 [(trace["cp_rank"], trace["dp_rank"]) for trace in traced])
            print("\n".join(comparison_lines(cfg.stages[index].name, ranks, traced)))
            print(f"  ({pricing})")


if __name__ == "__main__":
    sys.exit(main())
