"""RMSNorm as a module over ops.rms_norm (weight initialised to ones)."""

import torch
from torch import nn

from moe_pretrain.model.init import Constant
from moe_pretrain.ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.param_init = {"weight": Constant(1.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
