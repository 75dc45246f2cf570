"""Quantizing a GEMM operand to FP8 with per-block scales, and the GEMM of two quantized operands.

Shape legend: an operand is [M, K] with K contracted. A block of (br, bc) elements shares one scale; the
scale maps the block's amax to the format's largest value (power-of-two scales round that up to the next
power of two, so nothing overflows). Values beyond the range (a delayed scale older than a spike)
saturate, as in Transformer Engine.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_pretrain.fp8.recipes import Block

_TINY = 1e-12
"""amax floor: an all-zero block gets a finite scale (its values quantize to zero whatever it is)."""


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


@dataclass
class Quantized:
    data: torch.Tensor
    """[M, K] in an FP8 dtype."""
    scale_inv: torch.Tensor
    """[M / br, K / bc] fp32 (rounded up): data * scale_inv is the dequantized value."""
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * _per_element(self.scale_inv, self.block, self.data.shape)

    def transposed(self) -> "Quantized":
        """The same values as the operand [K, M]: the FP8 data and block scales transposed, no requantizing."""
        return Quantized(self.data.T, self.scale_inv.T, (self.block[1], self.block[0]))


def _per_element(scale_inv: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Block scales [ceil(M/br), ceil(K/bc)] spread over an [M, K] operand; a dimension holding one block stays
    1 and broadcasts (one scale: [1, 1], tensorwise and delayed; one per row: [M, 1]), so no copy of a scale
    is made along it."""
    rows, cols = shape
    if scale_inv.shape[0] > 1:
        scale_inv = scale_inv.repeat_interleave(block[0], 0)[:rows]
    if scale_inv.shape[1] > 1:
        scale_inv = scale_inv.repeat_interleave(block[1], 1)[:, :cols]
    return scale_inv


def block_amax(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax of each (br, bc) block of t [M, K] (the last blocks may be partial) -> [ceil(M/br), ceil(K/bc)]."""
    br, bc = block
    rows, cols = t.shape
    padded = F.pad(t.abs().float(), (0, -cols % bc, 0, -rows % br))
    return padded.unflatten(0, (-1, br)).unflatten(2, (-1, bc)).amax(dim=(1, 3))


def scale_inv_of(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """The fp32 inverse scale that maps `amax` (any shape: one per block) to the format's largest value."""
    scale_inv = amax.float().clamp_min(_TINY) / fp8_max(dtype)
    return torch.exp2(torch.ceil(torch.log2(scale_inv))) if power_of_two else scale_inv


def quantize(t: torch.Tensor, block: Block, dtype: torch.dtype, *, power_of_two: bool = False,
             amax: torch.Tensor | None = None) -> Quantized:
    """t [M, K] -> FP8 with one scale per block (None: one for the whole tensor). amax, a scalar or one per
    block, overrides the tensor's own (delayed scaling; the grouped engines' per-expert row scales)."""
    rows, cols = t.shape
    block = block or (max(rows, 1), max(cols, 1))
    if amax is None:
        amax = block_amax(t, block)
    scale_inv = scale_inv_of(amax.float().reshape(-1, 1) if amax.dim() == 0 else amax, dtype, power_of_two)
    limit = fp8_max(dtype)
    data = (t.float() / _per_element(scale_inv, block, t.shape)).clamp(-limit, limit).to(dtype)
    return Quantized(data, scale_inv, block)


_GEMM_MULTIPLE = 16
"""cuBLAS FP8 GEMMs need the contracted and the output-column dimensions multiples of 16 (the rows of the
left operand may be anything); zero padding, sliced off after, changes nothing."""


def _pad(t: torch.Tensor, rows: bool) -> torch.Tensor:
    """t padded with zeros to a multiple of 16 columns (and rows, when `rows`); a copy only where it must."""
    extra_rows = -t.shape[0] % _GEMM_MULTIPLE if rows else 0
    extra_cols = -t.shape[1] % _GEMM_MULTIPLE
    if not extra_rows and not extra_cols:
        return t.contiguous()
    padded = t.new_zeros(t.shape[0] + extra_rows, t.shape[1] + extra_cols)
    padded[:t.shape[0], :t.shape[1]] = t
    return padded


def scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in out_dtype. Two single-scale operands run torch's FP8 GEMM
    (torch._scaled_mm, tensorwise scales); others the exact emulation (dequantize, then an fp32 GEMM:
    products of FP8 values are exact in fp32)."""
    (m, k), n = a.data.shape, b.data.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.data.device)
    if a.scale_inv.numel() == 1 and b.scale_inv.numel() == 1:
        out = torch._scaled_mm(_pad(a.data, rows=False), _pad(b.data, rows=True).T, scale_a=a.scale_inv.reshape(()),
                               scale_b=b.scale_inv.reshape(()), out_dtype=out_dtype)
        return out[:m, :n]
    return (a.dequantize() @ b.dequantize().T).to(out_dtype)
