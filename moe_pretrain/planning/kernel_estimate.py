"""One launch's time as a GPU reaches it (the dry run's estimate), from a calibration table
(planning/calibration.py), beside the roofline bound the op census also keeps.

A GEMM is priced by its tiles: a library gives each output tile of the candidate shapes to one SM; the tiles run
in waves of the SM count, each tile's products at the measured ceiling's share of an SM, K split where the tiles
alone leave SMs idle (split-K, whose fp32 partials are written and read back); the operands stream in at the
memory fraction of HBM's bandwidth beside the waves, the result is written after them, and a fixed time covers
the pipeline's fill. A grouped GEMM (the experts') is the same over its groups, each with its mean rows:
quantisation then bites on the rows per expert. Fused attention runs its products at a measured fraction of the
peak, a Triton kernel its tensor-core products at another; every other launch streams its bytes. No launch is
shorter than the GPU's floor between kernels. What this cannot see: a kernel's own inefficiencies beyond
these (serial loops, bank conflicts), clocks, other tenants.
"""

import math

import torch

from moe_pretrain.planning.calibration import Calibration

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"})
"""aten ops that are one GEMM kernel (or one grouped GEMM)."""
_ATTENTION = frozenset({"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                        "_flash_attention_forward", "_efficient_attention_forward", "flex_attention"})
"""Fused attention's forward ops; each with `_backward` appended is its backward (the CPU reference that the dry
run plays for MLA is priced as the GPU's fused kernel would run it)."""
_FIRST_OPERAND = {"addmm": 1, "baddbmm": 1}
"""Where the left operand sits among the op's arguments (the others: first)."""


def dtype_key(dtype: torch.dtype) -> str:
    """The calibration's dtype for a GEMM's operands."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return "fp32" if dtype in (torch.float32, torch.float64) else "bf16"


def gemm_dims(name: str, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    """(groups, rows, columns, depth) of a GEMM op: rows x depth times depth x columns, `groups` times; a grouped
    product's groups take its mean rows (or depth, for the weights' gradients)."""
    first = _FIRST_OPERAND.get(name, 0)
    a, b = args[first], args[first + 1]
    if name in ("_grouped_mm", "_scaled_grouped_mm"):
        offs = kwargs.get("offs", args[2] if name == "_grouped_mm" and len(args) > 2 else
                          args[4] if len(args) > 4 else None)
        if a.dim() == 2 and b.dim() == 3:  # [T, K] x [G, K, N]: each group a slice of the rows
            groups = b.shape[0]
            return groups, max(1, a.shape[0] // groups), b.shape[-1], a.shape[1]
        if a.dim() == 2 and b.dim() == 2:  # [M, T] x [T, N] -> [G, M, N]: each group a slice of the depth
            groups = offs.shape[0] if offs is not None else 1
            return groups, a.shape[0], b.shape[1], max(1, a.shape[1] // groups)
        if a.dim() == 3 and b.dim() == 2:  # [G, M, K] x [K, T]: each group a slice of the columns
            groups = a.shape[0]
            return groups, a.shape[1], max(1, b.shape[1] // groups), a.shape[2]
    if a.dim() == 3:
        return a.shape[0], a.shape[1], b.shape[-1], a.shape[2]
    return 1, a.shape[0], b.shape[-1], a.shape[1]


def gemm_seconds(cal: Calibration, dims: tuple[int, int, int, int], dtype: str, in_bytes: int,
                 out_bytes: int) -> float:
    """A GEMM of `dims` (gemm_dims) reading `in_bytes` and writing `out_bytes`: the best of the calibration's
    tiles and split-K choices (module docstring)."""
    groups, m, n, k = dims
    per_sm = cal.peak_flops[dtype] * cal.gemm_ceiling[dtype] / cal.sms
    stream = cal.memory_bytes_s * cal.memory_fraction
    best = math.inf
    for rows, columns in cal.tiles:
        tiles = groups * -(-m // rows) * -(-n // columns)
        split = 1
        while True:
            waves = -(-tiles * split // cal.sms)
            products = waves * 2 * rows * columns * (k / split) / per_sm
            partials = (split - 1) * groups * m * n * 4
            best = min(best, max(products, in_bytes / stream) + (out_bytes + partials) / stream)
            split *= 2
            if k / split < cal.split_k_min or tiles * split > 2 * cal.sms:
                break
    return best + cal.gemm_fixed_s


def launch_seconds(cal: Calibration, name: str, flops: int, in_bytes: int, out_bytes: int,
                   args: tuple = (), kwargs: dict | None = None, kernel: bool = False) -> float:
    """One launch of aten op (or kernel) `name`: a GEMM by its tiles, fused attention and a Triton kernel
    (kernel=True: ours, fla's) by their products' fractions of the peak, the rest by their bytes; never under
    the GPU's floor."""
    stream = cal.memory_bytes_s * cal.memory_fraction
    moved = (in_bytes + out_bytes) / stream
    peak = cal.peak_flops["bf16"]
    if name in GEMMS and flops:
        first = args[_FIRST_OPERAND.get(name, 0)]
        seconds = gemm_seconds(cal, gemm_dims(name, args, kwargs or {}), dtype_key(first.dtype), in_bytes,
                               out_bytes)
    elif name.removesuffix("_backward") in _ATTENTION:
        fraction = cal.attention_fraction["backward" if name.endswith("_backward") else "forward"]
        seconds = max(flops / (peak * fraction), moved)
    elif flops:
        fraction = cal.kernel_fraction if kernel else cal.gemm_ceiling["bf16"]
        seconds = max(flops / (peak * fraction), moved)
    else:
        seconds = moved
    return max(seconds, cal.launch_gpu_s)
