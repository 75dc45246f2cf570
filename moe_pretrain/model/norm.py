"""RMSNorm as a module over ops.rms_norm (weight initialised to ones)."""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.model.init import Constant
from moe_pretrain.ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, kernels: Kernels = REFERENCES):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.param_init = {"weight": Constant(1.0)}
        self.fused = kernels.triton
        """The norm through our Triton kernel (gpu_kernels/rms_norm.py: one read of x, one write of y)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, fused=self.fused)
