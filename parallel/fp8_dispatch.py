"""The expert dispatch's rows sent as FP8 (parallel.dispatch_fp8): DeepSeek-V3's dispatch payload.

Each row's 1 x 128 blocks travel in e4m3 with one fp32 scale each (1 + 4/128 bytes a value against bf16's 2:
0.52x the bytes), dequantized to the sender's dtype on arrival (FP8_ROWS, the codec collectives.start_rows
takes). Only the forward's dispatch direction is quantized: the backward sends the gradients back in their
own dtype (straight-through: the quantization's gradient is taken as the identity, as for a quantized GEMM's
input), and combine stays in the rows' dtype.
The received rows are dequantized rather than handed to the FP8 expert GEMMs as they are (those quantize
their inputs again, in their recipe's blocks).
"""

import torch

from moe_pretrain.fp8.quantize import Quantized, quantize

BLOCK = (1, 128)
"""One scale per 128 values of a row."""


class FP8Rows:
    """collectives.RowCodec: a row's 1 x 128 blocks as e4m3 bytes (gloo carries no FP8 dtype; the bytes are the
    same) and one fp32 scale each."""

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        sent = quantize(x.contiguous(), BLOCK, torch.float8_e4m3fn)
        return [sent.data.view(torch.uint8), sent.scale_inv]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        data, scales = parts
        return Quantized(data.view(torch.float8_e4m3fn), scales, BLOCK).dequantize().to(dtype)


FP8_ROWS = FP8Rows()


def row_bytes(width: int, element_size: int, fp8: bool) -> int:
    """Bytes a row of `width` values of `element_size` bytes takes on the wire: its values, or as FP8 a byte a
    value and a scale a block (the dispatchers' counts and the plan's)."""
    return width + -(-width // BLOCK[1]) * 4 if fp8 else width * element_size
