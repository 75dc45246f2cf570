"""Depthwise causal short convolution (kernel 4, no bias) on KDA's q, k and v (docs/model.md).

Written as a sum over the few taps rather than conv1d so that a tap never reaches back across a
document boundary of a packed sequence: tap j contributes only where position_in_doc >= j. A piece of a
longer sequence (context parallel) passes the kernel - 1 positions before it as its halo.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.model.init import Uniform


class ShortConvolution(nn.Module):
    def __init__(self, channels: int, kernel_size: int, kernels: Kernels = REFERENCES):
        super().__init__()
        self.kernel_size = kernel_size
        self.fused = kernels.triton
        """The convolution and its SiLU through our Triton kernel (gpu_kernels/short_conv.py)."""
        bound = kernel_size**-0.5  # conv1d's default fan-in scale for a depthwise kernel
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.param_init = {"weight": Uniform(-bound, bound)}

    def forward(self, x_BTC: torch.Tensor, position_in_doc: torch.Tensor, halo: torch.Tensor | None = None, *,
                silu: bool = False) -> torch.Tensor:
        """x [B, T, C], position_in_doc [B, T], halo [B, kernel - 1, C] (the positions before x; zeros if
        None) -> [B, T, C], through SiLU where silu; weight[:, -1] multiplies the current token."""
        if self.fused and x_BTC.dtype in (torch.float32, torch.bfloat16, torch.float16):
            from gpu_kernels.short_conv import short_conv

            return short_conv(x_BTC, position_in_doc, halo, self.weight, silu)
        B, T, C = x_BTC.shape
        reach = self.kernel_size - 1
        if halo is None:
            halo = x_BTC.new_zeros(B, reach, C)
        extended = torch.cat([halo.to(x_BTC.dtype), x_BTC], dim=1)
        out = x_BTC * self.weight[:, -1]
        for lag in range(1, self.kernel_size):
            shifted = extended[:, reach - lag : reach - lag + T]
            valid = (position_in_doc >= lag).unsqueeze(-1).to(x_BTC.dtype)
            out = out + shifted * valid * self.weight[:, -1 - lag]
        return F.silu(out) if silu else out
