"""MoE permute / unpermute in Triton (reference: moe_pretrain.ops.permute).

permute gathers each routed copy's row into expert order: rows[r] = x[token_index[r]].
unpermute sums each token's k expert outputs with its combine weights: out[t] = sum_j w[t, j] rows[pos[t, j]],
where pos[t, j] is the expert-order position of copy j of token t (the inverse of the sort).
Each program owns one whole output row, so no atomics are needed in either direction:
- permute's backward is an unpermute with unit weights (a token's gradient is the sum of its copies');
- unpermute's backward writes grad_rows[pos[t, j]] = w[t, j] grad_out[t] (pos is a permutation, so every
  row is written once) and grad_w[t, j] = <rows[pos[t, j]], grad_out[t]>.
Sums accumulate in fp32 and are written in the rows' dtype.
"""

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from gpu_kernels.triton_support import row_tiles

WITHOUT_PRODUCTS = ("permute", "unpermute", "unpermute_backward")
"""Ops here that multiply no matrices: the op census prices them by their bytes (gathers and weighted sums)."""


@triton.jit
def _gather_rows(src_ptr, index_ptr, dst_ptr, count, width, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_rows = rows < count
    mask = in_rows[:, None] & (cols < width)[None, :]
    source = tl.load(index_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    values = tl.load(src_ptr + source[:, None] * width + cols[None, :], mask=mask)
    tl.store(dst_ptr + rows[:, None] * width + cols[None, :], values, mask=mask)


@triton.jit
def _weighted_row_sum(rows_ptr, positions_ptr, weights_ptr, out_ptr, num_tokens, width, K: tl.constexpr,
                      WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_tokens = tokens < num_tokens
    mask = in_tokens[:, None] & (cols < width)[None, :]
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for j in range(K):
        position = tl.load(positions_ptr + tokens * K + j, mask=in_tokens, other=0).to(tl.int64)
        row = tl.load(rows_ptr + position[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(weights_ptr + tokens * K + j, mask=in_tokens, other=0.0).to(tl.float32)[:, None]
        acc += row
    tl.store(out_ptr + tokens[:, None] * width + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward(grad_out_ptr, rows_ptr, positions_ptr, weights_ptr, grad_rows_ptr, grad_weights_ptr,
                        num_tokens, width, K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_tokens = tokens < num_tokens
    mask = in_tokens[:, None] & (cols < width)[None, :]
    grad = tl.load(grad_out_ptr + tokens[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    for j in range(K):
        position = tl.load(positions_ptr + tokens * K + j, mask=in_tokens, other=0).to(tl.int64)
        weight = tl.load(weights_ptr + tokens * K + j, mask=in_tokens, other=0.0).to(tl.float32)
        offsets = position[:, None] * width + cols[None, :]
        row = tl.load(rows_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_rows_ptr + offsets, (weight[:, None] * grad).to(grad_rows_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_weights_ptr + tokens * K + j, tl.sum(row * grad, axis=1).to(grad_weights_ptr.dtype.element_ty),
                 mask=in_tokens)


# Each kernel is a custom op with a fake implementation: fake tensors (the dry run) and torch.compile see one
# kernel and its outputs' shapes, never the launch.
@custom_op("moe_pretrain::permute", mutates_args=())
def _permute(x_TL: torch.Tensor, token_index: torch.Tensor, positions_TK: torch.Tensor) -> torch.Tensor:
    rows = x_TL.new_empty(token_index.shape[0], x_TL.shape[1])
    if rows.shape[0]:
        block, per_program = row_tiles(x_TL.shape[1])
        _gather_rows[(triton.cdiv(rows.shape[0], per_program),)](x_TL, token_index, rows, rows.shape[0],
                                                                 x_TL.shape[1], BLOCK=block, ROWS=per_program)
    return rows


@custom_op("moe_pretrain::unpermute", mutates_args=())
def _unpermute(rows_RL: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """Weighted (weights given) or plain (permute's backward) sums of each token's rows."""
    num_tokens, k = positions_TK.shape
    out = rows_RL.new_empty(num_tokens, rows_RL.shape[1])
    if num_tokens:
        block, per_program = row_tiles(rows_RL.shape[1])
        _weighted_row_sum[(triton.cdiv(num_tokens, per_program),)](
            rows_RL, positions_TK, weights_TK if weights_TK is not None else positions_TK, out, num_tokens,
            rows_RL.shape[1], K=k, WEIGHTED=weights_TK is not None, BLOCK=block, ROWS=per_program)
    return out


@custom_op("moe_pretrain::unpermute_backward", mutates_args=())
def _unpermute_backward_op(grad_out: torch.Tensor, rows_RL: torch.Tensor, positions_TK: torch.Tensor,
                           weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_rows, grad_weights = torch.empty_like(rows_RL), torch.empty_like(weights_TK)
    num_tokens, k = positions_TK.shape
    if num_tokens:
        block, per_program = row_tiles(rows_RL.shape[1])
        _unpermute_backward[(triton.cdiv(num_tokens, per_program),)](
            grad_out, rows_RL, positions_TK, weights_TK, grad_rows, grad_weights, num_tokens, rows_RL.shape[1], K=k,
            BLOCK=block, ROWS=per_program)
    return grad_rows, grad_weights


@_permute.register_fake
def _(x_TL: torch.Tensor, token_index: torch.Tensor, positions_TK: torch.Tensor) -> torch.Tensor:
    return x_TL.new_empty(token_index.shape[0], x_TL.shape[1])


@_unpermute.register_fake
def _(rows_RL: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    return rows_RL.new_empty(positions_TK.shape[0], rows_RL.shape[1])


@_unpermute_backward_op.register_fake
def _(grad_out: torch.Tensor, rows_RL: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(rows_RL), torch.empty_like(weights_TK)


def _save_positions(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[2])


def _permute_backward(ctx, grad_rows: torch.Tensor):
    """A token's gradient is the sum of its copies'."""
    (positions_TK,) = ctx.saved_tensors
    return _unpermute(grad_rows.contiguous(), positions_TK, None), None, None


def _save_unpermute(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _unpermute_grads(ctx, grad_out: torch.Tensor):
    rows_RL, positions_TK, weights_TK = ctx.saved_tensors
    grad_rows, grad_weights = _unpermute_backward_op(grad_out.contiguous(), rows_RL, positions_TK, weights_TK)
    return grad_rows, None, grad_weights


_permute.register_autograd(_permute_backward, setup_context=_save_positions)
_unpermute.register_autograd(_unpermute_grads, setup_context=_save_unpermute)


def permute(x_TL: torch.Tensor, token_index: torch.Tensor, positions_TK: torch.Tensor) -> torch.Tensor:
    """[T, L] -> [T * k, L] rows in expert order (x_TL[token_index]); positions_TK is the inverse map."""
    return _permute(x_TL.contiguous(), token_index.contiguous(), positions_TK.contiguous())


def unpermute(rows_RL: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """[T * k, L] expert-order rows -> [T, L] weighted sums per token, in the rows' dtype."""
    return _unpermute(rows_RL.contiguous(), positions_TK.contiguous(), weights_TK.contiguous())
