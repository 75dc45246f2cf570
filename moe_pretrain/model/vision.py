"""Native image input: flattened patches (moe_pretrain.data.patches) -> linear -> visual tokens."""

import torch
from torch import nn

from moe_pretrain.model.linear import make_linear


class PatchEmbedding(nn.Module):
    def __init__(self, patch_dim: int, dim: int, init_std: float):
        super().__init__()
        self.proj = make_linear(patch_dim, dim, bias=True, init_std=init_std)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)
