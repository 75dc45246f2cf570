"""One warmed training step profiled on this device, its kernels' time by the dry run's components, beside the dry
run's estimate and bound of the same step: which component the calibrated estimate misprices.

Run: python bench/step_profile.py [--config configs/probe_step_time.yaml] [--calibration FILE] [--warmup 2] [--dry]
The probe config (the full model's layer widths at one GPU's size) trains --warmup steps (the first compiles), then
one step runs under torch.profiler with every op wrapped in a range named by its component: the component of
the project line that made it, and in a backward the forward line that made its autograd node, as the dry run files
its launches (planning/compute_sites.py). Each component's measured time is its ranges' device time (kernels on
the GPU). The dry run (launch.dryrun, one GPU, the device's kernels, the GPU's calibration table or --calibration)
plays the same config's step; the table prints measured, estimate and bound per component, and the step's.

--dry runs the same code on this CPU with configs/smoke.yaml in bf16 (its ops' CPU time stands for the device's):
plumbing only, no GPU figure (bench/gpu_check.sh --dry).
"""

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from moe_pretrain.planning.compute_sites import ComputeSites, component

PREFIX = "component: "


class ComponentRanges(TorchDispatchMode):
    """Every op inside a profiler range named by its component (the ComputeSites mode beside it tags the autograd
    nodes the forward makes, so that a backward op finds its forward line)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with record_function(PREFIX + component(ComputeSites.current_site())):
            return func(*args, **(kwargs or {}))


def measured_by_component(events, device: torch.device) -> dict[str, float]:
    """Seconds by component: the device time of each component's ranges (CPU time on a CPU)."""
    seconds: collections.Counter = collections.Counter()
    for event in events:
        if event.name.startswith(PREFIX):
            total = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
            seconds[event.name[len(PREFIX):]] += total / 1e6
    return dict(seconds)


def profiled_step(configs: list[str], overrides: list[str], warmup: int, device: torch.device
                  ) -> tuple[dict[str, float], float]:
    """(measured seconds by component, the profiled step's wall seconds) of a warmed step of the config."""
    from moe_pretrain.config import load_config
    from moe_pretrain.log import setup_logging
    from moe_pretrain.training import Trainer
    from parallel.state import ParallelContext, init_parallel

    setup_logging(0)
    cfg = load_config(configs, [*overrides, f"train.steps={warmup + 1}", "data.prefetch=false"])
    trainer = Trainer(cfg, init_parallel(cfg) if device.type == "cuda" else ParallelContext.single("cpu"))
    for _ in range(warmup):
        trainer.train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, ComputeSites(), ComponentRanges():
        result = trainer.train_step()
    trainer.close()
    return measured_by_component(prof.events(), device), result.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[], help="default: configs/probe_step_time.yaml")
    parser.add_argument("--calibration", default="", help="the table the dry run's estimate takes (default: the "
                        "GPU's shipped one; bench/calibrate.py writes a measured one)")
    parser.add_argument("--gpu", default="", help="the GPU kind the dry run prices for (default: this device's)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dry", action="store_true", help="this CPU and configs/smoke.yaml: plumbing only")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("bench/step_profile.py profiles a CUDA GPU: none here (--dry runs the plumbing on the CPU)",
              file=sys.stderr)
        return 2
    from launch.dryrun import play
    from moe_pretrain.config import load_config
    from moe_pretrain.gpus import gpu_of_device
    from moe_pretrain.planning.calibration import calibration_for

    device = torch.device("cpu" if args.dry else "cuda")
    configs = args.config or (["configs/smoke.yaml"] if args.dry else ["configs/probe_step_time.yaml"])
    overrides = ["train.dtype=bfloat16"] if args.dry else []  # the probe's own dtype; the smoke model's in bf16
    found = gpu_of_device(torch.cuda.get_device_name()) if device.type == "cuda" else None
    gpu = args.gpu or (found.name if found else "h200")
    measured, wall = profiled_step(configs, overrides, args.warmup, device)
    calibration = calibration_for(gpu, args.calibration or None)
    trace = play(load_config(configs, overrides), 1, [0], 0, gpu, "here" if args.dry else "gpu", calibration)[0]
    estimate = trace["estimate"] or {"compute_by_component": {}, "step_s": 0.0}
    bound = {name: row[2] for name, row in trace["compute_by_component"].items()}
    names = sorted(set(measured) | set(bound), key=lambda name: -measured.get(name, 0.0))
    print(f"\none step of {' + '.join(configs)} on {'this CPU (dry: not a GPU figure)' if args.dry else gpu}; "
          f"estimate from {estimate.get('calibration', 'no table')}")
    print(f"{'component':36s} {'measured s':>11s} {'estimate s':>11s} {'bound s':>9s} {'measured / estimate':>20s}")
    for name in names:
        est = estimate["compute_by_component"].get(name, 0.0)
        ratio = f"{measured.get(name, 0.0) / est:20.2f}" if est else f"{'-':>20s}"
        print(f"{name:36s} {measured.get(name, 0.0):11.4g} {est:11.4g} {bound.get(name, 0.0):9.4g} {ratio}")
    print(f"{'the step (wall; the dry run: step)':36s} {wall:11.4g} {estimate['step_s']:11.4g} "
          f"{trace['step_s']:9.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
