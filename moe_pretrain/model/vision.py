"""Native image input: flattened patches -> linear -> visual tokens at the image's placeholder positions."""

import torch
from torch import nn

from parallel.linear import LinearStyle, make_linear


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[N, C, S, S] -> [N * (S/p)^2, C * p * p], patches in row-major order, channels outermost."""
    N, C, S, _ = images.shape
    g = S // patch_size
    x = images.reshape(N, C, g, patch_size, g, patch_size)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(N * g * g, C * patch_size * patch_size)


class PatchEmbedding(nn.Module):
    def __init__(self, patch_dim: int, dim: int, init_std: float):
        super().__init__()
        self.proj = make_linear(patch_dim, dim, style=LinearStyle.REPLICATED, bias=True, init_std=init_std)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)
