"""Measure what this GPU reaches and write it as a calibration table (moe_pretrain/planning/calibration.py), beside
every measured point with the shipped table's estimate of it.

Run: python bench/calibrate.py --out DIR [--gpu h100|h200] [--repeats 20] [--dry]
Writes DIR/calibration.yaml (launch.dryrun / launch.plan --calibration DIR/calibration.yaml) and
DIR/calibration_points.json, and prints each point: measured, estimated by the shipped table, their ratio.

Measured here, on one GPU: GEMMs (BF16, FP8 where torch._scaled_mm runs, FP32) at the shapes the full model's 8K
step runs and a few of the public tables' (the ceiling is the best of them over the dtype's peak; the fixed time is
the median excess of the small ones over the table's tiles and bytes); the experts' grouped GEMM
(torch._grouped_mm) at 128 to 2048 rows an expert; a copy's share of HBM's bandwidth; the GPU's time a kernel
between kernels queued back to back (a CUDA graph of tiny kernels replayed) and the host's time to issue one (the
same kernels issued eagerly). What one GPU cannot measure (the links; fused attention's and Triton kernels'
fractions) is carried over from the shipped table, each such figure's source saying so. Every time is the median
of --repeats after a warm-up, timed with CUDA events.

--dry runs the same code on this machine's CPU at small sizes (the plumbing of bench/gpu_check.sh --dry): its
table is no measurement of a GPU, and every figure's source says so.
"""

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is run as a script: its package from the root
from bench.fast_paths import median_time
from moe_pretrain.gpus import GPUS, gpu_of_device
from moe_pretrain.planning.calibration import CALIBRATIONS, Calibration, load_calibration
from moe_pretrain.planning.kernel_estimate import gemm_seconds

STEP_GEMMS = [(8192, 1792, 7168), (8192, 7168, 1792), (8192, 6144, 7168), (8192, 7168, 3072), (8192, 7168, 7168),
              (2048, 2048, 13312), (4096, 4096, 4096), (1024, 1024, 2048), (512, 2048, 1024), (256, 512, 256)]
"""(rows, columns, depth): the 8K step's projections at tp 4 (8192 tokens of a micro-batch, hidden 7168), the
public ceiling's best shape, and smaller ones that show the fixed time."""
EXPERT_ROWS = (128, 256, 512, 1024, 2048)
"""Rows an expert for the grouped GEMM: 7 local experts, latent 3584 to 2 x 3072 (the gate and up rows)."""
DRY_SCALE = 32
"""--dry divides every size by this (a CPU at these shapes takes seconds, not hours)."""


def gemm_points(device: torch.device, seconds_of, scale: int) -> list[dict]:
    """Each GEMM shape in each dtype this device runs: its measured time."""
    points = []
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("fp32", torch.float32)):
        for m, n, k in STEP_GEMMS:
            m, n, k = max(16, m // scale), max(16, n // scale), max(16, k // scale)
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(n, k, device=device).to(dtype).t()
            if dtype_name == "fp8":
                one = torch.ones((), device=device)
                try:
                    torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
                except (RuntimeError, NotImplementedError):
                    break  # this device has no FP8 GEMM
                run = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
            else:
                run = lambda a=a, b=b: a @ b  # noqa: E731
            element = a.element_size()
            points.append({"kind": "gemm", "dtype": dtype_name, "dims": [1, m, n, k], "seconds": seconds_of(run),
                           "in_bytes": (m * k + k * n) * element, "out_bytes": m * n * (4 if element == 4 else 2)})
    return points


def grouped_points(device: torch.device, seconds_of, scale: int) -> list[dict]:
    experts, latent, up = 7, max(16, 3584 // scale), max(16, 2 * 3072 // scale)
    weights = torch.randn(experts, latent, up, device=device, dtype=torch.bfloat16)
    points = []
    for rows in EXPERT_ROWS:
        rows = max(16, rows // scale)
        tokens = torch.randn(experts * rows, latent, device=device, dtype=torch.bfloat16)
        offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
        points.append({"kind": "grouped", "dtype": "bf16", "dims": [experts, rows, up, latent],
                       "seconds": seconds_of(lambda tokens=tokens, offs=offs: torch._grouped_mm(tokens, weights, offs)),
                       "in_bytes": (tokens.numel() + weights.numel()) * 2, "out_bytes": experts * rows * up * 2})
    return points


def memory_fraction(device: torch.device, seconds_of, scale: int, bytes_s: float) -> tuple[float, dict]:
    x = torch.empty((1 << 30) // scale // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    seconds = seconds_of(lambda: y.copy_(x))
    moved = 2 * x.numel() * x.element_size()
    return moved / seconds / bytes_s, {"kind": "copy", "bytes": moved, "seconds": seconds}


def launch_times(device: torch.device, seconds_of) -> tuple[float, float, dict]:
    """(the GPU's time a tiny kernel between kernels, the host's time to issue one)."""
    x, count = torch.zeros(1, device=device), 200

    def kernels() -> None:
        for _ in range(count):
            x.add_(1)

    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        kernels()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            kernels()
        gpu = seconds_of(graph.replay) / count
        began = time.perf_counter()
        kernels()
        host = (time.perf_counter() - began) / count
        torch.cuda.synchronize()
    else:  # a CPU runs what it issues: both are the eager loop's time a kernel
        gpu = host = seconds_of(kernels) / count
    return gpu, host, {"kind": "launch", "gpu_s": gpu, "host_s": host, "kernels": count}


def fixed_time(points: list[dict], table: Calibration) -> float:
    """The median excess of the GEMMs the table's tiles price under 50 us over that price (none: the table's)."""
    bare = dataclasses.replace(table, gemm_fixed_s=0.0)
    excess = [p["seconds"] - gemm_seconds(bare, tuple(p["dims"]), p["dtype"], p["in_bytes"], p["out_bytes"])
              for p in points if p["kind"] == "gemm" and
              gemm_seconds(bare, tuple(p["dims"]), p["dtype"], p["in_bytes"], p["out_bytes"]) < 50e-6]
    return max(0.0, statistics.median(excess)) if excess else table.gemm_fixed_s


def measured_table(shipped: Path, device_name: str, ceilings: dict[str, float], fraction: float, launch: tuple,
                   fixed: float, dry: bool) -> dict:
    """The shipped table's tree with the measured figures in place, every figure's source saying where it is
    from."""
    tree = yaml.safe_load(shipped.read_text())
    how = ("bench/calibrate.py --dry on this CPU: plumbing only, not a measurement of a GPU" if dry else
           f"measured by bench/calibrate.py on {device_name}, {time.strftime('%Y-%m-%d')}")

    def carried(node: dict) -> None:
        for child in node.values():
            if isinstance(child, dict) and "value" in child:
                child["source"] = f"carried over from {shipped.name} (one GPU does not measure it): {child['source']}"
            elif isinstance(child, dict):
                carried(child)

    carried({k: v for k, v in tree.items() if k not in ("gpu", "description")})
    def figure(value: float, what: str) -> dict:
        return {"value": float(f"{value:.4g}"), "source": f"{how}: {what}"}

    for dtype, ceiling in ceilings.items():
        tree["gemm"]["ceiling"][dtype] = figure(ceiling, "the best GEMM's FLOP/s over the peak")
    tree["gemm"]["fixed_s"] = figure(fixed, "the small GEMMs' median excess over tiles and bytes")
    tree["memory"]["fraction"] = figure(fraction, "a copy's bytes over the datasheet's")
    tree["launch"]["gpu_s"] = figure(launch[0], "a CUDA graph of tiny kernels replayed")
    tree["launch"]["host_s"] = figure(launch[1], "the same kernels issued eagerly")
    tree["description"] = f"{tree.get('description', '')}; {how}"
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the table and its points go to")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="",
                        help="the GPU kind the table is for (default: this device's; --dry: h200)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dry", action="store_true", help="run on this CPU at small sizes (plumbing only)")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("bench/calibrate.py measures a CUDA GPU: none here (--dry runs the plumbing on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry else "cuda")
    found = gpu_of_device(torch.cuda.get_device_name()) if device.type == "cuda" else None
    gpu = GPUS[args.gpu] if args.gpu else found or GPUS["h200"]
    shipped = CALIBRATIONS / f"{gpu.name}.yaml"
    if not shipped.exists():
        print(f"no shipped table for {gpu.name} to start from ({shipped})", file=sys.stderr)
        return 2
    table = load_calibration(shipped)
    scale, repeats = (DRY_SCALE, min(args.repeats, 3)) if args.dry else (1, args.repeats)
    seconds_of = functools.partial(median_time, device=device, repeats=repeats)
    points = gemm_points(device, seconds_of, scale) + grouped_points(device, seconds_of, scale)
    fraction, copy = memory_fraction(device, seconds_of, scale, table.memory_bytes_s)
    *launch, launch_point = launch_times(device, seconds_of)
    ceilings = {}
    for dtype in table.peak_flops:
        rates = [2 * p["dims"][0] * p["dims"][1] * p["dims"][2] * p["dims"][3] / p["seconds"]
                 for p in points if p["dtype"] == dtype and p["kind"] == "gemm"]
        if rates:
            ceilings[dtype] = min(1.0, max(rates) / table.peak_flops[dtype])
    tree = measured_table(shipped, "this CPU" if args.dry else torch.cuda.get_device_name(), ceilings, fraction,
                          tuple(launch), fixed_time(points, table), args.dry)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.yaml").write_text(yaml.safe_dump(tree, sort_keys=False, width=1000))
    measured = load_calibration(args.out / "calibration.yaml")  # refused here if any figure lacks its source
    print(f"{'point':40s} {'measured s':>11s} {'shipped est.':>12s} {'ratio':>6s} {'measured est.':>13s}")
    for point in points:
        dims = tuple(point["dims"])
        point["shipped_s"] = gemm_seconds(table, dims, point["dtype"], point["in_bytes"], point["out_bytes"])
        point["estimate_s"] = gemm_seconds(measured, dims, point["dtype"], point["in_bytes"], point["out_bytes"])
        name = f"{point['kind']} {point['dtype']} {'x'.join(map(str, dims))}"
        print(f"{name:40s} {point['seconds']:11.4g} {point['shipped_s']:12.4g} "
              f"{point['seconds'] / point['shipped_s']:6.2f} {point['estimate_s']:13.4g}")
    print(f"copy: {copy['bytes'] / copy['seconds'] / 1e9:.0f} GB/s, {fraction:.1%} of "
          f"{table.memory_bytes_s / 1e12:.2f} TB/s; a kernel: {launch[0] * 1e6:.2f} us on the device, "
          f"{launch[1] * 1e6:.2f} us to issue")
    (args.out / "calibration_points.json").write_text(json.dumps(
        {"device": "cpu (dry)" if args.dry else torch.cuda.get_device_name(), "points": [*points, copy, launch_point]},
        indent=1))
    print(f"wrote {args.out / 'calibration.yaml'} and {args.out / 'calibration_points.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
