"""Print a run's staged schedule, its duration, and its per-GPU memory and communication per stage.

    python -m launch.plan --config configs/full.yaml --config configs/stages/full.yaml --gpus 4096 --gpu h200
    python -m launch.plan --config configs/full.yaml --config configs/stages/full.yaml --gpus 4096 --propose
    python -m launch.plan --config configs/full.yaml --config configs/stages/full.yaml --gpus 2048 --propose --trace 2

Per stage: tokens, steps, sequence length, global batch, micro-batches, learning-rate range, and with
--gpus the training FLOPs per token (which grow with the attention span); then the memory plan
(moe_pretrain/planning/stage_memory.py) of the config's layout (parallel.* and each stage's cp, recompute and
micro-batches): the worst pipeline rank's GB per GPU, flagged when it does not fit, and the bytes each GPU
sends per step per group; then each stage's step time, MFU and days from the plan's step-time model
(planning/plan_step_time.py: no assumed MFU). --traces DIR sets the dry run's figures (launch.dryrun, kept
by bench/dry_run.py --traces DIR) beside the plan's, and takes its step time too. --propose searches layouts
and prints the smallest that fits every stage with 10% headroom, and the three fastest by the plan's model;
--trace N then plays the first N of those and the configured layout with the dry run on one stage (at each of
--dispatch-chunks) and ranks them by the traced step (planning/traced_ranking.py). A traced step is given twice:
its roofline bound and its estimate from the GPU's calibration table (configs/calibration/<gpu>.yaml, or
--calibration FILE); the ranking takes the estimate. --json FILE writes the step times (plan, and each traced
rank's bound and estimate) and the traced ranking, so that scripts need not parse the tables.
"""

import argparse
import dataclasses
import json
import os
import sys
from functools import partial
from pathlib import Path

from launch.dryrun import play
from moe_pretrain.config import EX_CONFIG, ConfigError, add_config_arguments, load_config_or_exit
from moe_pretrain.config.stage import Stage, resolve_stages
from moe_pretrain.gpus import GPUS, GpuSpec
from moe_pretrain.model.counts import count, total_parts
from moe_pretrain.planning.calibration import Calibration, calibration_for
from moe_pretrain.planning.collective_traffic import PLAN_COLUMNS, plan_columns
from moe_pretrain.planning.fastest_layouts import fastest_layouts
from moe_pretrain.planning.plan_step_time import (
    TRACE_KEYS,
    PlannedStep,
    column_links,
    plan_groups,
    planned_step,
    traced_stage_step,
)
from moe_pretrain.planning.plan_vs_dry_run import HEADER, comparison_lines, plan_of_traced_step
from moe_pretrain.planning.stage_memory import (
    HEADROOM,
    MemoryPlanner,
    RunLayout,
    gigabytes,
    within,
)
from moe_pretrain.planning.traced_ranking import TRACED_HEADROOM, candidates, layout_overlay, traced_ranking
from moe_pretrain.training.schedule import plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs in the cluster (0: no time estimate)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the GPU's peak")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="dry-run traces, DIR/<stage>.json (bench/dry_run.py --traces DIR): print them beside "
                             "the plan and give the days at their step time as well")
    parser.add_argument("--gpu-gb", type=float, default=0.0, help="override the GPU's memory (GB, 1e9 bytes)")
    parser.add_argument("--propose", action="store_true",
                        help="search the smallest layout that fits each stage, and the three fastest that fit them all")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="with --propose: play the first N fastest layouts and the configured one with the dry "
                             "run on one stage and rank them by the traced step")
    parser.add_argument("--trace-stage", default="", help="the stage --trace plays (default: the one the plan's "
                        "fastest layout spends the most days on)")
    parser.add_argument("--dispatch-chunks", default="", metavar="LIST",
                        help="parallel.dispatch_chunks values each traced layout is played at, e.g. 1,2,4 "
                             "(default: the config's)")
    parser.add_argument("--trace-roles", action="store_true",
                        help="play one rank of each pipeline role per layout (default: the middle rank)")
    parser.add_argument("--trace-json", type=Path, default=None, metavar="FILE",
                        help="write the traced ranking to FILE: each layout's config layer (its \"config\": "
                             "layer it last to take it), figures and traces")
    parser.add_argument("--calibration", default="",
                        help="the calibration table traced steps are estimated by (default: configs/calibration/"
                             "<gpu>.yaml where the project ships one)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the step times and the traced ranking to FILE (JSON)")
    args = parser.parse_intermixed_args(argv)
    if args.trace and not args.propose:
        parser.error("--trace needs --propose")
    cfg = load_config_or_exit(args)
    try:
        calibration = calibration_for(args.gpu, args.calibration or None)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EX_CONFIG
    if not cfg.stages:
        print("config error: the config has no stages section", file=sys.stderr)
        return EX_CONFIG
    traced_choices = trace_choices(cfg, args) if args.trace else (None, [])
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
    planner = MemoryPlanner(cfg)  # one for the whole command: its searches share the states and layers it caches
    code, planned = print_memory_plan(planner, args.gpus, args.gpu, args.propose, args.gpu_gb * 1e9)
    gpu = GPUS[args.gpu]
    if args.peak_tflops:
        gpu = dataclasses.replace(gpu, peak_flops=args.peak_tflops * 1e12)
    capacity = args.gpu_gb * 1e9 or GPUS[args.gpu].memory_bytes
    report = {"gpus": args.gpus, "gpu": gpu.name, "calibration": calibration.path if calibration else None,
              "stages": print_step_times(cfg, args.gpus, planned, gpu, args.traces, capacity)}
    print(verdict(planner, args.gpus, planned, capacity))
    if args.propose:
        ranked = print_fastest(planner, args.gpus, capacity, gpu, max(3, args.trace))
        if args.trace:
            report["traced_ranking"] = print_traced(planner, args, ranked[:args.trace], gpu, capacity, calibration,
                                                    *traced_choices)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return code


def trace_choices(cfg, args) -> tuple[int | None, list[int]]:
    """--trace-stage's stage index (None: the one the plan's winner spends the most days on) and --dispatch-chunks'
    values, checked before any planning (a config error exits EX_CONFIG in one line)."""
    names = [stage.name for stage in cfg.stages]
    if args.trace_stage and args.trace_stage not in names:
        print(f"config error: --trace-stage {args.trace_stage} is not a stage of the config ({', '.join(names)})",
              file=sys.stderr)
        sys.exit(EX_CONFIG)
    try:
        chunks = [int(c) for c in args.dispatch_chunks.split(",")] if args.dispatch_chunks else \
            [cfg.parallel.dispatch_chunks]
    except ValueError:
        chunks = [0]
    if min(chunks) < 1:
        print(f"config error: --dispatch-chunks {args.dispatch_chunks} must be positive integers, e.g. 1,2",
              file=sys.stderr)
        sys.exit(EX_CONFIG)
    return (names.index(args.trace_stage) if args.trace_stage else None), chunks


def verdict(planner: MemoryPlanner, gpus: int, planned: dict, capacity: float) -> str:
    """One line: whether the config's layout fits every stage (planned: each valid stage's plan by name), and
    where it does not, the smallest layout that fits (MemoryPlanner.propose's: searched once, with --propose or
    here)."""
    cfg = planner.cfg
    worst = {name: result["worst"]["total_bytes"] for name, result in planned.items()}
    problems = [f"{stage.name} has no valid layout" if stage.name not in planned else
                f"{stage.name} needs {worst[stage.name] / 1e9:.4g} GB of {capacity / 1e9:.4g}" for stage in cfg.stages
                if stage.name not in planned or not within(planned[stage.name], capacity)]
    if not problems:
        return (f"verdict: fits: every stage within {capacity / 1e9:.4g} GB a GPU (the most, "
                f"{max(worst.values()) / 1e9:.4g} GB, at {max(worst, key=worst.get)})")
    found = planner.propose(gpus, capacity)
    if found is None or any(stage is None for stage in found[1]):
        nearest = f"no layout of {gpus} GPUs fits every stage with {HEADROOM:.0%} headroom"
    else:
        run, stages = found
        nearest = f"the smallest that fits with {HEADROOM:.0%} headroom is {run.describe()} with " + ", ".join(
            f"{stage.name} {stage.describe()}" for stage, _ in stages)
    return f"verdict: does not fit: {'; '.join(problems)}; {nearest} (--propose)"


def _step(step: PlannedStep) -> dict:
    return {"step_s": step.step_s, "mfu": step.mfu, "days": step.days}


def print_traced(planner: MemoryPlanner, args, ranked: list, gpu: GpuSpec, capacity: float,
                 calibration: Calibration | None, stage: int | None, chunks: list[int]) -> list[dict]:
    """The first of the plan's ranking and the configured layout played by the dry run on `stage` (None: the
    one the plan's winner spends the most days on), fastest traced step (the estimate, where there is a
    calibration) first (planning/traced_ranking.py); returned as launch.plan --json writes it."""
    cfg = planner.cfg
    names = [s.name for s in cfg.stages]
    if stage is None:
        stage = max(range(len(names)), key=lambda i: ranked[0].stages[i][1].days) if ranked else 0
    found, left_out = candidates(planner, args.gpus, stage, ranked, chunks, gpu)
    rank_note = "one rank of each pipeline role" if args.trace_roles else "the middle pipeline rank"
    print(f"\nthe stage {names[stage]} traced ({rank_note} of each layout, the stage's first micro-batches scaled "
          f"to its step), fitting with {TRACED_HEADROOM:.0%} headroom first, then by the traced step:")
    traced, refused = traced_ranking(cfg, args.gpus, stage, found,
                                     partial(play, gpu=args.gpu, calibration=calibration), gpu, capacity,
                                     args.trace_roles)
    refused = left_out + refused
    width = max([len(t.candidate.describe(stage)) for t in traced] + [6])
    print(f"   {'layout':{width}s} {'from':>10s} | plan: {'step s':>7s} {'MFU':>6s} | traced: {'cut':>3s} "
          f"{'compute':>8s} {'exposed':>8s} {'peak GB':>8s} {'fits':>4s} | bound: {'step s':>7s} {'MFU':>6s} | "
          f"estimate: {'step s':>7s} {'MFU':>6s} {'days':>7s}")
    for place, t in enumerate(traced, start=1):
        slowest = max(t.traces, key=lambda trace: trace["step_s"])
        print(f"{place:2d}. {t.candidate.describe(stage):{width}s} {t.candidate.source:>10s} | "
              f"{t.candidate.planned.step_s:13.4g} {t.candidate.planned.mfu:6.1%} | {t.cut_micro_batches:11d} "
              f"{slowest['compute_s']:8.4g} {sum(slowest['exposed_s'].values()):8.4g} {t.peak_bytes / 1e9:8.2f} "
              f"{'yes' if t.fits(capacity) else 'NO':>4s} | {t.bound.step_s:14.4g} {t.bound.mfu:6.1%} | "
              f"{t.step.step_s:17.4g} {t.step.mfu:6.1%} {t.step.days:7.4g}")
    for line in refused:
        print(f"    refused by the start-up checks: {line}")
    ranking = [{"layout": t.candidate.describe(stage), "source": t.candidate.source, "stage": names[stage],
                "config": layout_overlay(cfg, t.candidate), "cut_micro_batches": t.cut_micro_batches,
                "fits": t.fits(capacity), "peak_bytes": t.peak_bytes, "plan": _step(t.candidate.planned),
                "bound": _step(t.bound), "estimate": _step(t.step) if t.step is not t.bound else None}
               for t in traced]
    if args.trace_json:
        args.trace_json.write_text(json.dumps([{**row, **row["estimate" if row["estimate"] else "bound"],
                                                "traces": t.traces} for row, t in zip(ranking, traced)], indent=1))
    return ranking


def print_fastest(planner: MemoryPlanner, gpus: int, capacity: float, gpu: GpuSpec, count: int = 3) -> list:
    """The `count` run layouts on which every stage fits, fewest planned days first, each stage at its fastest
    fitting layout (planning/fastest_layouts.py); returned."""
    ranked = fastest_layouts(planner, gpus, capacity, gpu, count)
    print(f"\nfastest layouts that fit every stage with {HEADROOM:.0%} headroom, by the plan's step time (FLOPs at "
          f"the peak, the all-to-all counted whole): trace the first two with the dry run before taking one "
          f"(--trace 2)")
    if not ranked:
        print(f"none: no run layout of {gpus} GPUs fits every stage")
    for place, layout in enumerate(ranked, start=1):
        print(f"{place}. {layout.run.describe()}: {layout.days:.4g} days")
        for stage, step in layout.stages:
            print(f"   {stage.name:8s} {stage.describe():29s} step {step.step_s:9.4g} s  MFU {step.mfu:6.1%} "
                  f"{step.days:9.4g} days")
    return ranked


def print_memory_plan(planner: MemoryPlanner, gpus: int, gpu: str, propose: bool, capacity: float = 0.0
                      ) -> tuple[int, dict]:
    """The memory plan of the config's layout (and with propose, the proposed one's): the exit code, and each
    valid stage's plan on the config's layout by name (MemoryPlanner.stage)."""
    cfg = planner.cfg
    capacity = capacity or GPUS[gpu].memory_bytes
    p = cfg.parallel
    run = RunLayout(gpus, p.tp, p.pp, p.ep, p.vpp)
    print(f"\nmemory per GPU, GB, worst pipeline rank ({gpu}: {capacity / 1e9:.3g} GB), layout {run.describe()}")
    all_fit, planned = print_stages(planner, run, list(resolve_stages(cfg)), capacity)
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


def print_stages(planner: MemoryPlanner, run: RunLayout, stages: list[Stage | None], capacity: float
                 ) -> tuple[bool, dict]:
    """Whether every stage fits (None: no layout of it fits), and each valid stage's plan by name."""
    columns = ("params", "grads", "optim", "copies", "mixers", "activ", "a2a", "qb", "vision", "total", "host")
    print(f"{'stage':8s} {'layout':29s} {'dp':>5s} " + " ".join(f"{c:>7s}" for c in columns) + f" {'fits':>5s} | "
          f"GB sent/step: "
          f"{'tp':>6s} {'ep':>6s} {'pp':>6s} {'cp':>6s} {'dp':>6s} | {'NVLink':>6s} {'NIC':>6s}")
    all_fit, planned = True, {}
    for entry, stage in zip(planner.cfg.stages, stages, strict=True):
        if stage is None:
            all_fit = False
            print(f"{entry.name:8s} {'-':29s} no layout fits (see below)")
            continue
        problems = planner.problems(run, stage)
        if problems:
            all_fit = False
            print(f"{stage.name:8s} {stage.describe():29s} invalid: {'; '.join(problems)}")
            continue
        result = planned[stage.name] = planner.stage(run, stage)
        w, c = result["worst"], plan_columns(result["communication"])
        nvlink, nic = column_links(result["communication"], plan_groups(planner.cfg, run, stage.cp),
                                   planner.cfg.cluster)
        fits = within(result, capacity)
        all_fit &= fits
        sizes = [w[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "compute_copy_bytes",
                                "mixer_state_bytes", "activation_bytes", "buffer_bytes", "balancing_bytes")]
        sizes += [result["first"]["vision_bytes"], w["total_bytes"], result["host_bytes"]]
        print(f"{stage.name:8s} {stage.describe():29s} {result['dp']:5d} " + " ".join(map(gigabytes, sizes))
              + f" {'yes' if fits else 'NO':>5s} |               "
              + " ".join(gigabytes(c[k], 6) for k in PLAN_COLUMNS) + " | "
              + " ".join(gigabytes(x, 6) for x in (nvlink, nic)))
        if w["muon_flops"]:
            print(f"{'':8s} Muon: {w['muon_flops'] / 1e12:.1f} TFLOP of Newton-Schulz per GPU and step (in the step's "
                  f"FLOPs), its exchange in dp's column and its tp slices' joins in tp's; its step holds "
                  f"{w['muon_step_bytes'] / 1e9:.1f} GB after the activations are freed")
    return all_fit, planned


def _traced_ranks(traces: list[dict]) -> list[dict]:
    """Each traced rank's own cut step, bound and (where it has one) estimate, for launch.plan --json."""
    def priced(view: dict) -> dict:
        return {"step_s": view["step_s"], "mfu": view["mfu"], "compute_s": view["compute_s"],
                "exposed_s": view["exposed_s"]}

    return [{"rank": trace["rank"], "role": trace["role"], "micro_batches": trace["micro_batches"],
             "peak_bytes": trace["peak_bytes"], "bound": priced(trace),
             "estimate": priced(trace["estimate"]) if trace["estimate"] else None} for trace in traces]


def print_step_times(cfg, gpus: int, planned: dict, gpu: GpuSpec, traces: Path | None, capacity: float
                     ) -> list[dict]:
    """Each stage's step time, MFU and days on the config's layout: the plan's model (on planned, each valid
    stage's plan by name), and with traces the dry run's (its predicted rank times scaled to the stage's
    micro-batches, with the same bubble), on the roofline bound and on the calibrated estimate where the traces
    carry one. A stage that does not fit in `capacity` bytes says so on its line, and the total says how many.
    Returned as launch.plan --json writes it."""
    p = cfg.parallel
    run = RunLayout(gpus, p.tp, p.pp, p.ep, p.vpp)
    print(f"\nstep time on {gpus} x {gpu.name} ({gpu.peak_flops / 1e12:.0f} TFLOP/s dense peak), layout "
          f"{run.describe()}: the plan's FLOPs at the peak (a bound: memory-bound ops are the dry run's to count), "
          f"its communication on the links it crosses, the 1F1B bubble; MFU counts MLA's attention at one document "
          f"per row in the plan's columns, at the documents the traced step ran in the dry run's; the dry run's "
          f"step on the roofline bound and on the calibrated estimate")
    print(f"{'stage':8s} {'step s':>8s} {'MFU':>6s} {'days':>7s}" + (
        f" | dry run, bound: {'step s':>8s} {'MFU':>6s} {'days':>7s} | estimate: {'step s':>8s} {'MFU':>6s} "
        f"{'days':>7s}" if traces else ""))
    days = {"plan": 0.0, "bound": 0.0, "estimate": 0.0}
    rows = []
    traced_stages = []
    for index, stage in enumerate(resolve_stages(cfg)):
        if stage.name not in planned:
            print(f"{stage.name:8s} {'-':>8s} (no valid layout)")
            rows.append({"stage": stage.name, "plan": None})
            continue
        step = planned_step(cfg, run, stage, planned[stage.name]["ranks"], gpu, cfg.cluster)
        days["plan"] += step.days
        row = {"stage": stage.name, "plan": _step(step), "fits": within(planned[stage.name], capacity)}
        line = f"{stage.name:8s} {step.step_s:8.2f} {step.mfu:6.1%} {step.days:7.1f}"
        if not row["fits"]:
            line += " (does not fit)"
        found = traces / f"{stage.name}.json" if traces else None
        if found and found.exists():
            traced = json.loads(found.read_text())
            if missing := TRACE_KEYS - set(traced[0]):
                print(f"{found}: a trace without {', '.join(sorted(missing))} (made by an older dry run): trace "
                      f"the stage again (bench/dry_run.py --stage {stage.name} --traces {traces})", file=sys.stderr)
                sys.exit(os.EX_DATAERR)
            bound = traced_stage_step(cfg, run, stage, traced, gpu)
            days["bound"] += bound.days
            row["bound"], row["ranks"] = _step(bound), _traced_ranks(traced)
            line += f" |                 {bound.step_s:8.2f} {bound.mfu:6.1%} {bound.days:7.1f}"
            if all(trace["estimate"] for trace in traced):
                estimate = traced_stage_step(cfg, run, stage, traced, gpu, "estimate")
                days["estimate"] += estimate.days
                row["estimate"] = _step(estimate)
                line += f" |           {estimate.step_s:8.2f} {estimate.mfu:6.1%} {estimate.days:7.1f}"
            traced_stages.append((index, traced))
        rows.append(row)
        print(line)
    if not planned:
        print("total days: - (no stage has a valid layout)")
        return rows
    summary = f"total days: {days['plan']:.1f} (plan)"
    unfit = len(cfg.stages) - sum(within(result, capacity) for result in planned.values())
    if unfit:
        summary += f", though {unfit} of {len(cfg.stages)} stages do not fit or have no valid layout"
    if traced_stages:
        names = ", ".join(cfg.stages[i].name for i, _ in traced_stages)
        summary += f", {days['bound']:.1f} (dry run, bound), {days['estimate']:.1f} (dry run, estimate; stages {names})"
    print(summary)
    if traced_stages:
        print("\nthe plan beside the dry run (ratios traced / plan; the plan of the traced step's micro-batches)")
        print(HEADER)
        for index, traced in traced_stages:
            ranks, pricing = plan_of_traced_step(cfg, run, index, traced[0]["micro_batches"],
                                                 [(trace["cp_rank"], trace["dp_rank"]) for trace in traced])
            print("\n".join(comparison_lines(cfg.stages[index].name, ranks, traced)))
            print(f"  ({pricing})")
    return rows


if __name__ == "__main__":
    sys.exit(main())
