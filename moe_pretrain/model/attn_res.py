"""One AttnRes mix: a learned pseudo-query and RMSNorm weight over the bank (MODEL.md, "AttnRes").

The pseudo-query starts at zero, so at initialisation a mix is the plain average of the bank.
"""

import torch
from torch import nn

from moe_pretrain.ops import attn_res_mix
from parallel.linear import LinearStyle, make_linear


class AttnResMix(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.pseudo_query = make_linear(dim, 1, style=LinearStyle.REPLICATED, init_std=0.0)
        self.norm_weight = nn.Parameter(torch.ones(dim))

    def forward(self, bank: list[torch.Tensor]) -> torch.Tensor:
        """bank: N tensors [B, T, d] -> [B, T, d]."""
        if len(bank) == 1:
            return bank[0]
        return attn_res_mix(torch.stack(bank), self.pseudo_query.weight, self.norm_weight, self.eps)
