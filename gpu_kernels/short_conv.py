"""Fused depthwise causal short convolution with its SiLU, forward and backward, in Triton (reference:
moe_pretrain.model.short_conv.ShortConvolution, then F.silu).

Shape legend: B rows, T positions, C channels, K taps (R = K - 1 positions of halo before a context-parallel
fragment), position t of row b; x_src(b, t) is x[b, t] for t >= 0 and halo[b, R + t] for t < 0.

pre[b, t] = sum_j w[:, K-1-j] x_src(b, t - j) over the taps j with position_in_doc[b, t] >= j (a tap never
reaches back across a document's start), y = SiLU(pre) in fp32, written in x's dtype. Forward: each program
reads its tile of x (and the halo) and writes y. Backward: for each source position s (the halo's too), its
gradient is sum_j w[:, K-1-j] dpre[b, s + j] over the taps that read it, with dpre = dy SiLU'(pre) and pre
recomputed from x (K taps for each of K neighbours, from the cache); the same terms times x_src(s) give the
weight's gradient, summed per program into one [K, C] partial. The eager reference runs a dozen elementwise
ops per tap over [B, T, C] memory, forward and backward; this reads x and dy and writes y, dx (and dhalo) once.
"""

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from gpu_kernels.triton_support import row_tiles

WITHOUT_PRODUCTS = ("short_conv", "short_conv_backward")
"""Ops here that multiply no matrices: the op census prices them by their bytes."""
PARTIAL_PROGRAMS = 128
"""Row programs of the backward at most (per channel block): each sums its rows' weight gradient."""


@triton.jit
def _source(x_ptr, halo_ptr, b, t, ok, c, in_c, T, C, R: tl.constexpr, HAS_HALO: tl.constexpr):
    """x_src(b, t) [ROWS, BLOCK_C] in fp32 (0 where not ok)."""
    from_x = ok & (t >= 0)
    value = tl.load(x_ptr + (b * T + t)[:, None] * C + c[None, :], mask=from_x[:, None] & in_c[None, :],
                    other=0.0).to(tl.float32)
    if HAS_HALO:
        from_halo = ok & (t < 0)
        value += tl.load(halo_ptr + (b * R + R + t)[:, None] * C + c[None, :],
                         mask=from_halo[:, None] & in_c[None, :], other=0.0).to(tl.float32)
    return value


@triton.jit
def _pre(x_ptr, halo_ptr, pos_ptr, w_ptr, b, t, ok, c, in_c, T, C, K: tl.constexpr, R: tl.constexpr,
         HAS_HALO: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The convolution at (b, t) [ROWS, BLOCK_C] in fp32, for the rows that are ok."""
    pos = tl.load(pos_ptr + b * T + t, mask=ok, other=0)
    acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + c * K + (K - 1 - j), mask=in_c, other=0.0).to(tl.float32)
        acc += _source(x_ptr, halo_ptr, b, t - j, ok & (pos >= j), c, in_c, T, C, R, HAS_HALO) * w[None, :]
    return acc


@triton.jit
def _short_conv_forward(x_ptr, halo_ptr, pos_ptr, w_ptr, y_ptr, BT, T, C, K: tl.constexpr, R: tl.constexpr,
                        HAS_HALO: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok, in_c = rows < BT, c < C
    b, t = rows // T, rows % T
    y = _pre(x_ptr, halo_ptr, pos_ptr, w_ptr, b, t, ok, c, in_c, T, C, K, R, HAS_HALO, ROWS, BLOCK_C)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok[:, None] & in_c[None, :])


@triton.jit
def _short_conv_backward(dy_ptr, x_ptr, halo_ptr, pos_ptr, w_ptr, dx_ptr, dhalo_ptr, partial_ptr, B, T, C,
                         K: tl.constexpr, K_POW2: tl.constexpr, R: tl.constexpr, HAS_HALO: tl.constexpr,
                         SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, PROGRAMS: tl.constexpr):
    program = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < C
    taps = tl.arange(0, K_POW2)
    dw = tl.zeros([K_POW2, BLOCK_C], dtype=tl.float32)
    span = T + R  # a row's source positions: its halo's R, then its T
    for block in range(program, tl.cdiv(B * span, ROWS), PROGRAMS):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        ok = rows < B * span
        b, s = rows // span, rows % span - R
        x_s = _source(x_ptr, halo_ptr, b, s, ok, c, in_c, T, C, R, HAS_HALO)
        d_src = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            t = s + j  # the output position whose tap j reads source s
            reads = ok & (t >= 0) & (t < T)
            reads = reads & (tl.load(pos_ptr + b * T + t, mask=reads, other=0) >= j)
            dpre = tl.load(dy_ptr + (b * T + t)[:, None] * C + c[None, :], mask=reads[:, None] & in_c[None, :],
                           other=0.0).to(tl.float32)
            if SILU:
                pre = _pre(x_ptr, halo_ptr, pos_ptr, w_ptr, b, t, reads, c, in_c, T, C, K, R, HAS_HALO, ROWS, BLOCK_C)
                gate = tl.sigmoid(pre)
                dpre = dpre * gate * (1.0 + pre * (1.0 - gate))
            w = tl.load(w_ptr + c * K + (K - 1 - j), mask=in_c, other=0.0).to(tl.float32)
            d_src += dpre * w[None, :]
            dw += tl.where(taps[:, None] == j, tl.sum(dpre * x_s, axis=0)[None, :], 0.0)
        in_x = ok & (s >= 0)
        tl.store(dx_ptr + (b * T + s)[:, None] * C + c[None, :], d_src.to(dx_ptr.dtype.element_ty),
                 mask=in_x[:, None] & in_c[None, :])
        if HAS_HALO:
            in_halo = ok & (s < 0)
            tl.store(dhalo_ptr + (b * R + R + s)[:, None] * C + c[None, :], d_src.to(dhalo_ptr.dtype.element_ty),
                     mask=in_halo[:, None] & in_c[None, :])
    tl.store(partial_ptr + (program * K_POW2 + taps)[:, None] * C + c[None, :], dw, mask=in_c[None, :])


def _tiles(C: int) -> tuple[int, int]:
    """(ROWS, BLOCK_C): channels in blocks of at most 128 (the model's thousands split over programs)."""
    block_c = min(triton.next_power_of_2(C), 128)
    return row_tiles(block_c)[1], block_c


@custom_op("moe_pretrain::short_conv", mutates_args=())
def short_conv_forward(x: torch.Tensor, positions: torch.Tensor, halo: torch.Tensor | None, weight: torch.Tensor,
                       silu: bool) -> torch.Tensor:
    """y [B, T, C] in x's dtype from contiguous x [B, T, C], positions [B, T] (each position's offset in its
    document), halo [B, K - 1, C] or None (zeros) and weight [C, K]. A custom op with a fake implementation:
    the dry run sees one kernel that reads x (and the halo) and writes y."""
    B, T, C = x.shape
    K = weight.shape[1]
    y = torch.empty_like(x)
    rows, block_c = _tiles(C)
    if B * T:
        _short_conv_forward[(triton.cdiv(B * T, rows), triton.cdiv(C, block_c))](
            x, halo if halo is not None else x, positions, weight, y, B * T, T, C, K=K, R=K - 1,
            HAS_HALO=halo is not None, SILU=silu, ROWS=rows, BLOCK_C=block_c)
    return y


@custom_op("moe_pretrain::short_conv_backward", mutates_args=())
def short_conv_backward(grad: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, halo: torch.Tensor | None,
                        weight: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dhalo ([B, 0, C] without a halo), dweight fp32 [C, K])."""
    B, T, C = x.shape
    K = weight.shape[1]
    grad_x = torch.empty_like(x)
    grad_halo = torch.empty_like(halo) if halo is not None else x.new_empty(B, 0, C)
    rows, block_c = _tiles(C)
    programs = max(1, min(triton.cdiv(B * (T + K - 1), rows), PARTIAL_PROGRAMS))
    k_pow2 = triton.next_power_of_2(K)
    partial = torch.zeros(programs, k_pow2, C, dtype=torch.float32, device=x.device)
    if B * T:
        _short_conv_backward[(programs, triton.cdiv(C, block_c))](
            grad, x, halo if halo is not None else x, positions, weight, grad_x,
            grad_halo if halo is not None else grad_x, partial, B, T, C, K=K, K_POW2=k_pow2,
            R=(K - 1) if halo is not None else 0, HAS_HALO=halo is not None, SILU=silu, ROWS=rows,
            BLOCK_C=block_c, PROGRAMS=programs)
    return grad_x, grad_halo, partial.sum(0)[:K].flip(0).t().contiguous()


@short_conv_forward.register_fake
def _(x: torch.Tensor, positions: torch.Tensor, halo: torch.Tensor | None, weight: torch.Tensor, silu: bool
      ) -> torch.Tensor:
    return torch.empty_like(x)


@short_conv_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, halo: torch.Tensor | None, weight: torch.Tensor,
      silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_halo = torch.empty_like(halo) if halo is not None else x.new_empty(x.shape[0], 0, x.shape[2])
    return torch.empty_like(x), grad_halo, weight.new_empty(weight.shape, dtype=torch.float32)


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, positions, halo, weight, silu = inputs
    ctx.save_for_backward(x, positions, halo, weight)
    ctx.silu = silu


def _backward(ctx, grad_y: torch.Tensor):
    x, positions, halo, weight = ctx.saved_tensors
    grad_x, grad_halo, grad_w = short_conv_backward(grad_y.contiguous(), x, positions, halo, weight, ctx.silu)
    return grad_x, None, grad_halo if halo is not None else None, grad_w.to(weight.dtype), None


short_conv_forward.register_autograd(_backward, setup_context=_save)


def short_conv(x_BTC: torch.Tensor, positions: torch.Tensor, halo: torch.Tensor | None, weight: torch.Tensor,
               silu: bool) -> torch.Tensor:
    """The fused kernel; same contract as ShortConvolution.forward (then SiLU where silu)."""
    if x_BTC.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kernels.short_conv: x in fp32 / bf16 / fp16, got {x_BTC.dtype}")
    halo = halo.to(x_BTC.dtype).contiguous() if halo is not None else None
    return short_conv_forward(x_BTC.contiguous(), positions.contiguous(), halo, weight.contiguous(), silu)
