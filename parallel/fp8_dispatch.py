"""The expert dispatch's rows sent as FP8 (parallel.dispatch_fp8): DeepSeek-V3's dispatch payload.

Each row's 1 x 128 blocks travel in e4m3 with one fp32 scale each (1 + 4/128 bytes a value against bf16's 2:
0.52x the bytes), dequantized to the sender's dtype on arrival. Only the forward's dispatch direction is
quantized: the backward sends the gradients back in their own dtype (straight-through: the quantization's
gradient is taken as the identity, as for a quantized GEMM's input), and combine stays in the rows' dtype.
The received rows are dequantized rather than handed to the FP8 expert GEMMs as they are (those quantize
their inputs again, in their recipe's blocks).
"""

import torch
import torch.distributed as dist

from moe_pretrain.fp8.quantize import Quantized, quantize
from parallel.collectives import all_to_all_rows, group_size

BLOCK = (1, 128)
"""One scale per 128 values of a row."""


class _FP8Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        sent = quantize(x.contiguous(), BLOCK, torch.float8_e4m3fn)
        data = all_to_all_rows(sent.data.view(torch.uint8), output_splits, input_splits, group)  # gloo: no FP8 dtype
        scales = all_to_all_rows(sent.scale_inv, output_splits, input_splits, group)
        return Quantized(data.view(torch.float8_e4m3fn), scales, BLOCK).dequantize().to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def row_bytes(x: torch.Tensor, fp8: bool) -> int:
    """Bytes one row of x [rows, width] takes on the wire: its values, or as FP8 a byte a value and a scale a
    block."""
    width = x.shape[1]
    return width + -(-width // BLOCK[1]) * 4 if fp8 else width * x.element_size()


def all_to_all_rows_fp8(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                        group: dist.ProcessGroup | None) -> torch.Tensor:
    """collectives.all_to_all_rows with the rows quantized on the way (module docstring); a group of one
    returns x as it is."""
    if group_size(group) == 1:
        return x
    return _FP8Rows.apply(x, output_splits, input_splits, group)
