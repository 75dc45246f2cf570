"""Fused AttnRes mix, forward and backward, in Triton (reference: moe_pretrain.ops.attn_res.attn_res_mix).

Shape legend: N bank entries, M tokens (rows), D hidden width.

h = sum_i p_i V_i, p = softmax_i(s_i), s_i = r_i (V_i . u), r_i = (mean(V_i^2) + eps)^-1/2, u = w * g (the
pseudo-query times the norm weight: w . RMSNorm(V_i) folded into one dot product), all in fp32.

Forward: one program per row reads each entry once, with an online softmax (a running maximum rescales the
accumulated mix, as flash attention does over keys), and writes the mix and each entry's probability (N fp32 a
row, kept for the backward). Backward: one pass per row reads the incoming gradient dh, the mix h and each entry
once and writes each entry's gradient, using sum_j p_j (dh . V_j) = dh . h for the softmax's backward:
    dp_i = dh . V_i,  ds_i = p_i (dp_i - dh . h),
    dV_i = p_i dh + ds_i r_i (u - s_i r_i V_i / D),  du += ds_i r_i V_i  (dw = du g, dg = du w).
The eager reference stacks the bank, casts it to fp32, normalises all of it and sums weighted copies: about
twenty passes over [N, M, D] memory for the same work. tanh-free; no autotuning (one configuration per width).
"""

import torch
import triton
import triton.language as tl
from torch.library import custom_op
from torch.utils.flop_counter import register_flop_formula

from gpu_kernels.triton_support import row_tiles

PARTIAL_PROGRAMS = 256
"""Programs of the backward at most: each sums its rows' du in registers and writes one [D] partial."""


@triton.jit
def _attn_res_forward(bank, u_ptr, out_ptr, probs_ptr, M, eps, D: tl.constexpr, N: tl.constexpr,
                      BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    in_rows = rows < M
    mask = in_rows[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)[None, :]
    for i in tl.static_range(N):
        v = tl.load(bank[i] + offsets, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        s = r * tl.sum(v * u, axis=1)
        tl.store(probs_ptr + i * M + rows, s, mask=in_rows)  # the score, until its probability overwrites it
        if i == 0:
            top = s
            total = s * 0.0 + 1.0
            acc = v
        else:
            new_top = tl.maximum(top, s)
            scale = tl.exp(top - new_top)
            weight = tl.exp(s - new_top)
            acc = acc * scale[:, None] + weight[:, None] * v
            total = total * scale + weight
            top = new_top
    tl.store(out_ptr + offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    for i in tl.static_range(N):
        s = tl.load(probs_ptr + i * M + rows, mask=in_rows, other=0.0)
        tl.store(probs_ptr + i * M + rows, tl.exp(s - top) / total, mask=in_rows)


@triton.jit
def _attn_res_backward(grad_ptr, out_ptr, bank, grad_bank, u_ptr, probs_ptr, partial_ptr, M, eps,
                       D: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                       PROGRAMS: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)[None, :]
    du = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(program, tl.cdiv(M, ROWS), PROGRAMS):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        in_rows = rows < M
        mask = in_rows[:, None] & (cols < D)[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        dh = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        mean_dp = tl.sum(dh * h, axis=1)
        for i in tl.static_range(N):
            v = tl.load(bank[i] + offsets, mask=mask, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
            s = r * tl.sum(v * u, axis=1)
            p = tl.load(probs_ptr + i * M + rows, mask=in_rows, other=0.0)
            ds = p * (tl.sum(dh * v, axis=1) - mean_dp)
            dv = p[:, None] * dh + (ds * r)[:, None] * (u - (s * r)[:, None] * v / D)
            tl.store(grad_bank[i] + offsets, dv.to(grad_bank[i].dtype.element_ty), mask=mask)
            du += tl.sum((ds * r)[:, None] * v, axis=0)
    tl.store(partial_ptr + program * D + cols, du, mask=cols < D)


def _rows(bank: list[torch.Tensor]) -> int:
    return bank[0].numel() // bank[0].shape[-1]


def _out_dtype(bank: list[torch.Tensor]) -> torch.dtype:
    """The reference's: torch.stack promotes the entries' dtypes (the embedding's fp32 beside bf16 layers)."""
    dtype = bank[0].dtype
    for entry in bank[1:]:
        dtype = torch.promote_types(dtype, entry.dtype)
    return dtype


@custom_op("moe_pretrain::attn_res_mix", mutates_args=())
def attn_res_mix_forward(bank: list[torch.Tensor], u: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mix [..., D] in the entries' promoted dtype, the probabilities [N, M] fp32) from contiguous entries
    [..., D] of one shape and u [D] fp32. A custom op with a fake implementation: the dry run sees one kernel
    that reads the bank once and writes the mix and its probabilities."""
    D, M, N = bank[0].shape[-1], _rows(bank), len(bank)
    out = torch.empty(bank[0].shape, dtype=_out_dtype(bank), device=bank[0].device)
    probs = torch.empty(N, M, dtype=torch.float32, device=bank[0].device)
    block, rows = row_tiles(D)
    _attn_res_forward[(triton.cdiv(M, rows),)](tuple(bank), u, out, probs, M, eps, D=D, N=N, BLOCK_D=block,
                                               ROWS=rows)
    return out, probs


@custom_op("moe_pretrain::attn_res_mix_backward", mutates_args=())
def attn_res_mix_backward(grad: torch.Tensor, out: torch.Tensor, bank: list[torch.Tensor], u: torch.Tensor,
                          probs: torch.Tensor, eps: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each entry's gradient in its dtype, the gradient of u [D] fp32)."""
    D, M, N = bank[0].shape[-1], _rows(bank), len(bank)
    grad_bank = [torch.empty_like(entry) for entry in bank]
    block, rows = row_tiles(D)
    programs = min(triton.cdiv(M, rows), PARTIAL_PROGRAMS)
    partial = torch.empty(programs, D, dtype=torch.float32, device=grad.device)
    _attn_res_backward[(programs,)](grad, out, tuple(bank), tuple(grad_bank), u, probs, partial, M, eps, D=D, N=N,
                                    BLOCK_D=block, ROWS=rows, PROGRAMS=programs)
    return grad_bank, partial.sum(0)


@attn_res_mix_forward.register_fake
def _(bank: list[torch.Tensor], u: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = bank[0].new_empty(bank[0].shape, dtype=_out_dtype(bank))
    return out, bank[0].new_empty(len(bank), _rows(bank), dtype=torch.float32)


@attn_res_mix_backward.register_fake
def _(grad: torch.Tensor, out: torch.Tensor, bank: list[torch.Tensor], u: torch.Tensor, probs: torch.Tensor,
      eps: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [torch.empty_like(entry) for entry in bank], u.new_empty(u.shape)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    bank, u, eps = inputs
    out, probs = output
    ctx.save_for_backward(out, u, probs, *bank)
    ctx.eps = eps


def _backward(ctx, grad_out: torch.Tensor, _grad_probs: torch.Tensor | None):
    out, u, probs, *bank = ctx.saved_tensors
    grad_bank, grad_u = attn_res_mix_backward(grad_out.contiguous(), out, bank, u, probs, ctx.eps)
    return grad_bank, grad_u, None


attn_res_mix_forward.register_autograd(_backward, setup_context=_save)


@register_flop_formula(torch.ops.moe_pretrain.attn_res_mix)
def _forward_flops(bank: list[torch.Size], u: torch.Size, eps: float, *, out_shape=None, **kwargs) -> int:
    """The scores' products, as the reference's product of the normed bank with the query counts them (its
    FLOPs and the plan's stay comparable; the rest is elementwise, priced by the kernel's bytes)."""
    return 2 * len(bank) * torch.Size(bank[0]).numel()


@register_flop_formula(torch.ops.moe_pretrain.attn_res_mix_backward)
def _backward_flops(grad: torch.Size, out: torch.Size, bank: list[torch.Size], *args, out_shape=None,
                    **kwargs) -> int:
    """The reference's two gradient products of the scores (the normed bank's and the query's)."""
    return 4 * len(bank) * torch.Size(bank[0]).numel()


def attn_res_mix(bank: list[torch.Tensor], pseudo_query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float = 1e-5) -> torch.Tensor:
    """The fused kernel; same contract as moe_pretrain.ops.attn_res_mix, with the bank as its N entries [..., D]
    (never stacked)."""
    shape, dtypes = bank[0].shape, {entry.dtype for entry in bank}
    if any(entry.shape != shape for entry in bank) or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise ValueError(f"kernels.attn_res_mix: entries of one shape in fp32 / bf16 / fp16, got "
                         f"{[(tuple(e.shape), e.dtype) for e in bank]}")
    u = pseudo_query.reshape(-1).float() * norm_weight.float()
    out, _ = attn_res_mix_forward([entry.contiguous() for entry in bank], u, float(eps))
    return out
