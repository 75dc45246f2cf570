"""Fused RMSNorm, forward and backward, in Triton (reference: moe_pretrain.ops.norms.rms_norm).

Shape legend: M rows, D width.

y = x r w with r = (mean(x^2) + eps)^-1/2 per row, in fp32, written in x's dtype or a dtype asked for (the cast
that follows a norm, folded into its write). Forward: one read of x, one
write of y and of r (one fp32 a row, kept for the backward). Backward: one read of dy and x, one write of dx:
    x^ = x r,  dx = r (dy w - x^ mean(dy w x^)),  dw = sum over rows of dy x^
(each program sums its rows' dw in registers and writes one [D] partial). The eager reference makes about eight
passes over [M, D] memory, two of them fp32 copies. No autotuning (one configuration per width).
"""

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from gpu_kernels.triton_support import row_tiles

WITHOUT_PRODUCTS = ("rms_norm", "rms_norm_backward")
"""Ops here that multiply no matrices: the op census prices them by their bytes."""
PARTIAL_PROGRAMS = 256
"""Programs of the backward at most: each sums its rows' dw in registers and writes one [D] partial."""


@triton.jit
def _rms_norm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, M, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    in_rows = rows < M
    mask = in_rows[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(y_ptr + offsets, (x * r[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, r, mask=in_rows)


@triton.jit
def _rms_norm_backward(grad_ptr, x_ptr, w_ptr, rstd_ptr, grad_x_ptr, partial_ptr, M, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PROGRAMS: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(program, tl.cdiv(M, ROWS), PROGRAMS):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        in_rows = rows < M
        mask = in_rows[:, None] & (cols < D)[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        dy = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
        x_hat = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * r[:, None]
        dyw = dy * w
        dx = r[:, None] * (dyw - x_hat * (tl.sum(dyw * x_hat, axis=1) / D)[:, None])
        tl.store(grad_x_ptr + offsets, dx.to(grad_x_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(partial_ptr + program * D + cols, dw, mask=cols < D)


@custom_op("moe_pretrain::rms_norm", mutates_args=())
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in out_dtype, r [M] fp32) from contiguous x [..., D] and weight [D]. A custom op with a fake
    implementation: the dry run sees one kernel that reads x once and writes y and r."""
    D = x.shape[-1]
    M = x.numel() // D
    y = torch.empty_like(x, dtype=out_dtype)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        block, rows = row_tiles(D)
        _rms_norm_forward[(triton.cdiv(M, rows),)](x, weight, y, rstd, M, eps, D=D, BLOCK_D=block, ROWS=rows)
    return y, rstd


@custom_op("moe_pretrain::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw fp32)."""
    D = x.shape[-1]
    M = x.numel() // D
    grad_x = torch.empty_like(x)
    block, rows = row_tiles(D)
    programs = max(1, min(triton.cdiv(M, rows), PARTIAL_PROGRAMS))
    partial = torch.zeros(programs, D, dtype=torch.float32, device=x.device)
    if M:
        _rms_norm_backward[(programs,)](grad, x, weight, rstd, grad_x, partial, M, D=D, BLOCK_D=block, ROWS=rows,
                                        PROGRAMS=programs)
    return grad_x, partial.sum(0)


@rms_norm_forward.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=out_dtype), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@rms_norm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_y: torch.Tensor, _grad_rstd: torch.Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_w = rms_norm_backward(grad_y.contiguous(), x, weight, rstd)
    return grad_x, grad_w.to(weight.dtype), None, None


rms_norm_forward.register_autograd(_backward, setup_context=_save)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """The fused kernel; same contract as moe_pretrain.ops.rms_norm with a weight (fp32 math, y in out_dtype,
    x's by default)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.shape != x.shape[-1:]:
        raise ValueError(f"kernels.rms_norm: x in fp32 / bf16 / fp16 and a weight of its width, got {x.dtype} "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    return rms_norm_forward(x.contiguous(), weight.contiguous(), float(eps), out_dtype or x.dtype)[0]
