"""One AttnRes mix: a learned pseudo-query and RMSNorm weight over the bank (docs/model.md, "AttnRes").

The pseudo-query starts at zero, so at initialisation a mix is the plain average of the bank.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.model.init import Constant
from moe_pretrain.model.linear import make_linear
from moe_pretrain.ops import attn_res_mix


class AttnResMix(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.eps = eps
        self.fused = kernels.triton
        """The mix through our Triton kernel (gpu_kernels/attn_res.py): the bank's entries read once, unstacked."""
        self.pseudo_query = make_linear(dim, 1, init_std=0.0)
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.param_init = {"norm_weight": Constant(1.0)}

    def forward(self, bank: list[torch.Tensor]) -> torch.Tensor:
        """bank: N tensors [B, T, d] -> [B, T, d]; a one-entry bank (layer 0's attention mix) is returned as it
        is, leaving this mix's parameters without a gradient (decoder_layer.py says why they exist)."""
        if len(bank) == 1:
            return bank[0]
        return attn_res_mix(bank, self.pseudo_query.weight, self.norm_weight, self.eps, fused=self.fused)
