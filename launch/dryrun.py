"""Play ranks of an N-GPU job in this CPU process: the real training step with fake tensors over torch's fake
process-group backend, and what each rank allocates, computes, sends and reads on the host.

    python -m launch.dryrun --config configs/full.yaml --config configs/stages/full.yaml --gpus 2048 --stage 8k
    python -m launch.dryrun configs/smoke.yaml parallel.tp=2 parallel.pp=2 parallel.ep=2 --gpus 8 --rank 7

By default one rank of each pipeline role (first stage: embeddings and the vision tower; a middle one;
last: logits and the multi-token-prediction blocks), each in its own process. Routing that the model's
arithmetic would decide is assumed (config key dry_run.expert_load: balanced, or a load factor per expert); the data's
document boundaries are the real loader's (moe_pretrain/planning/dry_run.py says what is real and what is
assumed). Each step is priced twice: the roofline bound (every GEMM at the dense peak, links at line rate, launches
free) and the estimate beside it, from the GPU's calibration table (configs/calibration/<gpu>.yaml, or
--calibration FILE: moe_pretrain/planning/calibration.py). What it cannot tell: numerics, and kernel speed
beyond what the table says.
"""

import argparse
import dataclasses
import json
import multiprocessing
import sys
import traceback

from moe_pretrain.config import EX_CONFIG, Config, ConfigError, add_config_arguments, load_config_or_exit
from moe_pretrain.gpus import GPUS
from moe_pretrain.planning.calibration import Calibration, calibration_for

GB = 1e9


def _play(args: tuple) -> dict:
    cfg, gpus, rank, stage, gpu, kernels, calibration = args
    from moe_pretrain.log import setup_logging
    from moe_pretrain.planning.dry_run import dry_run

    setup_logging(0)

    try:
        return dataclasses.asdict(dry_run(cfg, gpus, rank, stage, GPUS[gpu], kernels == "gpu", calibration))
    except Exception as err:  # torch's errors may not pickle back to the parent: send the text
        raise RuntimeError(f"rank {rank}: {traceback.format_exc()}") from err


def play(cfg: Config, gpus: int, ranks: list[int], stage: int, gpu: str = "h200", kernels: str = "gpu",
         calibration: Calibration | None = None) -> list[dict]:
    """The traces (planning/dry_run.StepTrace as dicts) of `ranks` of a `gpus`-GPU job running the first step of
    stage index `stage`, each rank in a fresh process: the fake world is a process's default group. calibration:
    the table the estimate is priced by (None: the bound alone)."""
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.map(_play, [(cfg, gpus, rank, stage, gpu, kernels, calibration) for rank in ranks])


def print_trace(trace: dict) -> None:
    print(f"rank {trace['rank']} ({trace['role']}), {trace['layout']}: {trace['seconds']:.1f} s here")
    print("  kernels: " + "; ".join(f"{path}: {state}" for path, state in trace["kernels"].items()))
    print(f"  live tensor bytes: peak {trace['peak_bytes'] / GB:.3f} GB, at the step's start "
          f"{trace['state_bytes'] / GB:.3f} GB, while building {trace['build_peak_bytes'] / GB:.3f} GB; of the "
          f"state: parameters {trace['param_bytes'] / GB:.3f}, gradients {trace['grad_bytes'] / GB:.3f}, "
          f"optimizer {trace['optimizer_bytes'] / GB:.3f} GB")
    for site, size in trace["peak_sites"].items():
        print(f"    at the peak {size / GB:8.3f} GB made by {site}")
    print(f"  {trace['flops'] / 1e12:.4g} TFLOP in {trace['launches']} kernel launches")
    for group, (calls, size) in trace["collectives"].items():
        print(f"  {group:>8s}: {calls:5d} collectives, {size / GB:.4g} GB, "
              f"{trace['collective_s'].get(group, 0.0) * 1e3:.3g} ms on the fabric, "
              f"{trace['exposed_s'].get(group, 0.0) * 1e3:.3g} ms of it exposed")
    for site, size in trace["collective_sites"].items():
        print(f"    {size / GB:8.3f} GB by {site}")
    for name, size in list(trace["bytes_by_op"].items())[:8]:
        print(f"    {size / GB:8.1f} GB read and written by {name}")
    print("  compute by component (launches, GB read and written, bound s, estimate s):")
    for name, (launches, size, seconds, estimated) in trace["compute_by_component"].items():
        print(f"    {launches:8d} {size / GB:10.1f} {seconds:8.4f} {estimated:8.4f}  {name}")
    print(f"  bound: step {trace['step_s']:.4g} s (compute {trace['compute_s']:.4g} s at the roofline, "
          f"{trace['compute_once_s']:.4g} s of it once a step, {trace['bytes_moved'] / GB:.4g} GB moved; collectives "
          f"the compute waits for {sum(trace['exposed_s'].values()):.4g} s), MFU {trace['mfu']:.1%} (attention "
          f"over the step's documents: {trace['attended_keys']:.0f} keys a query)")
    estimate = trace["estimate"]
    if estimate:
        print(f"  estimate ({estimate['calibration']}): step {estimate['step_s']:.4g} s (kernels "
              f"{estimate['kernels_s']:.4g} s, {estimate['compute_once_s']:.4g} s of them once a step; the stream "
              f"idle for the host {estimate['host_wait_s']:.4g} s, slowed beside collectives "
              f"{estimate['contention_s']:.4g} s; collectives the compute waits for "
              f"{sum(estimate['exposed_s'].values()):.4g} s), MFU {estimate['mfu']:.1%}")
        for group in sorted(set(trace["exposed_s"]) | set(estimate["exposed_s"])):
            bound_s, estimate_s = trace["exposed_s"].get(group, 0.0), estimate["exposed_s"].get(group, 0.0)
            print(f"    exposed {group:>8s}: bound {bound_s:.4g} s, estimate {estimate_s:.4g} s (on the links: "
                  f"{trace['collective_s'].get(group, 0.0):.4g} / {estimate['collective_s'].get(group, 0.0):.4g} s)")
    for site, n in trace["host_reads"].items():
        print(f"  host read: {n} x {site}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, required=True, help="world size of the job to play")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                        help="the target whose roofline and peak the step time is predicted for")
    parser.add_argument("--calibration", default="",
                        help="the calibration table the estimate is priced by (default configs/calibration/<gpu>.yaml, "
                             "where the project ships one; a GPU's measured one: bench/gpu_check.sh writes it)")
    parser.add_argument("--kernels", choices=["gpu", "here"], default="gpu",
                        help="the kernels the model is built with: those a CUDA GPU resolves (default), or this "
                             "machine's (to compare with a real run here)")
    parser.add_argument("--rank", type=int, action="append", default=[], help="a rank to play (repeatable; "
                        "default: one of each pipeline role)")
    parser.add_argument("--stage", default="", help="the stage (name in cfg.stages) whose first step runs")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="run only the step's first N micro-batches (a multiple of parallel.pp: the pipeline's "
                             "peak is reached in its warm-up); figures are then those of N micro-batches")
    parser.add_argument("--json", default="", help="also write the traces to this file")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config_or_exit(args)
    names = [s.name for s in cfg.stages]
    if args.stage and args.stage not in names:
        print(f"config error: --stage {args.stage} is not a stage of the config ({', '.join(names) or 'none'})",
              file=sys.stderr)
        return EX_CONFIG
    stage = names.index(args.stage) if args.stage else 0
    from moe_pretrain.planning.dry_run import first_micro_batches, role_ranks

    if args.micro_batches:
        if not cfg.stages:
            print("--micro-batches needs a staged config", file=sys.stderr)
            return 2
        try:
            cfg = first_micro_batches(cfg, stage, args.micro_batches)
        except ValueError as err:
            print(f"--micro-batches: {err}", file=sys.stderr)
            return 2

    from parallel.state import resolve_layout

    try:  # a layout the world cannot hold fails here, in one line, before any rank is played
        resolve_layout(cfg, args.gpus)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EX_CONFIG
    try:
        calibration = calibration_for(args.gpu, args.calibration or None)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EX_CONFIG
    ranks = args.rank or role_ranks(args.gpus, cfg.parallel.pp)
    bad = [r for r in ranks if not 0 <= r < args.gpus]
    if bad:
        print(f"--rank {bad[0]} is not a rank of {args.gpus} GPUs", file=sys.stderr)
        return 2
    traces = play(cfg, args.gpus, ranks, stage, args.gpu, args.kernels, calibration)
    for trace in traces:
        print_trace(trace)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(traces, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
