"""The expert fast paths against their references, timed in one run: fused SiTU-GLU vs eager, permute
kernels vs eager, grouped GEMM vs the per-expert loop, FP8 vs bf16 expert GEMM, achieved TFLOP/s of the
expert GEMMs against a plain bf16 matmul of the same size, and each FP8 recipe's error against bf16's.

Run: .venv/bin/python bench/fast_paths.py [--experts 8 --rows 2048 --latent 3584 --intermediate 3072]
Defaults: full-size expert widths (latent 3584, intermediate 3072) on a GPU, a small shape on a CPU.
Every time is the median of --repeats forward + backward passes after a warm-up; every ratio divides the
named reference's time by the fast path's (> 1: the fast path is faster), both measured here. The Triton
rows need CUDA (under the CPU interpreter they would time the interpreter). Prints one table last.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gpu_kernels.choice import Kernels
from gpu_kernels.triton_support import triton_unavailable_reason
from moe_pretrain.fp8 import RECIPES, Fp8Experts, fp8_grouped_mm, fp8_unavailable_reason
from moe_pretrain.fp8.scaled_grouped_mm import scaled_grouped_mm_unavailable_reason
from moe_pretrain.fp8.settings import Engine, Fp8Settings
from moe_pretrain.fp8.transformer_engine import te_unavailable_reason
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher
from moe_pretrain.ops import grouped_mm, situ_glu
from moe_pretrain.ops.grouped_mm import grouped_kernel_unavailable_reason


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median of `repeats` runs of fn after a warm-up: on a GPU the device's time between two CUDA events
    (not the host's, which a sync would add to a short kernel), on a CPU the wall clock."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
    return step


ENGINES: tuple[Engine, ...] = ("torch", "scaled_grouped_mm", "transformer_engine")


def engine_reason(recipe: str, engine: Engine, device: torch.device) -> str | None:
    """Why this FP8 engine cannot run `recipe` here (the torch loop: blocked recipes only on CPU)."""
    if engine == "transformer_engine":
        return te_unavailable_reason(RECIPES[recipe], device)
    if engine == "scaled_grouped_mm":
        return scaled_grouped_mm_unavailable_reason(RECIPES[recipe], device)
    return fp8_unavailable_reason(recipe, device)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=7, help="local experts (7: 896 experts over ep 128)")
    parser.add_argument("--rows", type=int, default=2048 if cuda else 256, help="routed rows per expert")
    parser.add_argument("--latent", type=int, default=3584 if cuda else 256)
    parser.add_argument("--intermediate", type=int, default=3072 if cuda else 256)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10 if cuda else 3)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    E, L, F = args.experts, args.latent, args.intermediate
    R = E * args.rows
    counts = torch.full((E,), args.rows, device=device)
    x = torch.randn(R, L, device=device, dtype=dtype)
    w = torch.randn(E, F, L, device=device, dtype=dtype) * L ** -0.5
    rows: list[tuple[str, str, str]] = []

    def timed(name: str, fast: Callable[[], None], reference: Callable[[], None], reference_name: str) -> None:
        fast_s, ref_s = median_time(fast, device, args.repeats), median_time(reference, device, args.repeats)
        rows.append((name, f"{fast_s * 1e3:.3f} ms",
                     f"{ref_s / fast_s:.2f}x vs {reference_name} ({ref_s * 1e3:.3f} ms)"))

    if reason := triton_unavailable_reason(device) if cuda else "needs CUDA (on a CPU it would time the interpreter)":
        rows.append(("fused SiTU-GLU", "skipped", reason))
        rows.append(("dispatch + combine (permute kernels)", "skipped", reason))
    else:
        gate, up = torch.randn(R, F, device=device, dtype=dtype), torch.randn(R, F, device=device, dtype=dtype)

        def situ(fused):
            def run(g, u):
                return situ_glu(g, u, fused=fused)
            return forward_backward(run, gate, up)
        timed("fused SiTU-GLU fwd+bwd", situ(True), situ(False), "eager")
        local_k = min(args.top_k, E)  # a token's choices among this rank's experts
        tokens = R // local_k
        topk = torch.rand(tokens, E, device=device).topk(local_k, dim=1).indices
        hidden = torch.randn(tokens, L, device=device, dtype=dtype)
        weights = torch.rand(tokens, local_k, device=device)

        def moved(fused):
            dispatcher = LocalTokenDispatcher(E, fused=fused)

            def run(h, wt):
                rows, _, meta = dispatcher.dispatch(h, topk, wt)
                return dispatcher.combine(rows, meta)
            return forward_backward(run, hidden, weights)
        timed("dispatch + combine fwd+bwd (permute kernels)", moved(True), moved(False), "eager")

    def gemm(choice):
        def run(a, b):
            return grouped_mm(a, b, counts, choice)
        return run

    grouped_reason = grouped_kernel_unavailable_reason(device, dtype, L, F)
    if grouped_reason:
        rows.append(("grouped GEMM", "skipped", grouped_reason))
        bf16_choice = "loop"
    else:
        timed("grouped GEMM fwd+bwd", forward_backward(gemm("grouped"), x, w), forward_backward(gemm("loop"), x, w),
              "per-expert loop")
        bf16_choice = "grouped"
    def fp8_gemm(recipe: str, engine: Engine):
        settings = Fp8Settings(RECIPES[recipe], 16, engine)
        owner = GroupedExperts(E, L, F, beta=4.0, linear_beta=25.0, init_std=0.02, out_std=0.02,
                               kernels=Kernels(fp8=settings)).to(device)

        def run(a, b):
            return fp8_grouped_mm(a, b, counts, Fp8Experts(settings, owner), "gate")
        return run

    fp8_runs = {}
    for recipe in RECIPES:
        for engine in ENGINES:
            if reason := engine_reason(recipe, engine, device):
                rows.append((f"FP8 {recipe} via {engine}", "skipped", reason))
                continue
            fp8_runs[recipe, engine] = fp8_gemm(recipe, engine)
            timed(f"FP8 {recipe} via {engine} expert GEMM fwd+bwd", forward_backward(fp8_runs[recipe, engine], x, w),
                  forward_backward(gemm(bf16_choice), x, w), f"bf16 {bf16_choice}")

    flops = 2 * R * L * F
    plain_w = w[0].T.contiguous()
    plain_s = median_time(lambda: x @ plain_w, device, args.repeats)
    forwards = {f"bf16 {bf16_choice} expert GEMM fwd": lambda: gemm(bf16_choice)(x, w)}
    for (recipe, engine), run in fp8_runs.items():
        forwards[f"FP8 {recipe} via {engine} expert GEMM fwd"] = lambda run=run: run(x, w)
    with torch.no_grad():
        for name, fn in forwards.items():
            seconds = median_time(fn, device, args.repeats)
            rows.append((name, f"{flops / seconds / 1e12:.1f} TFLOP/s",
                         f"{plain_s / seconds:.2f}x of plain bf16 matmul ({flops / plain_s / 1e12:.1f} TFLOP/s)"))

    reference = torch.cat([part.double() @ w[e].double().T for e, part in enumerate(x.split(args.rows))])

    def error(y: torch.Tensor) -> float:
        return ((y.double() - reference).norm() / reference.norm()).item()
    with torch.no_grad():
        bf16_error = error(grouped_mm(x, w, counts))
        for (recipe, engine), run in fp8_runs.items():
            y = run(x, w)
            rows.append((f"FP8 {recipe} via {engine} forward error", f"{error(y):.4f}",
                         f"{error(y) / bf16_error:.1f}x bf16's {bf16_error:.4f} (vs float64)"))

    print(f"\nexpert fast paths on {torch.cuda.get_device_name() if cuda else 'CPU'}: {E} experts x {args.rows} rows, "
          f"latent {L}, intermediate {F}, bf16, median of {args.repeats}")
    width = max(len(r[0]) for r in rows)
    for name, value, ratio in rows:
        print(f"{name:{width}s}  {value:>16s}  {ratio}")


if __name__ == "__main__":
    main()
