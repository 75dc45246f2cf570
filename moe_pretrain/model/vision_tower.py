"""The vision tower and projector of the model class: a MoonViT-style encoder at native resolution.

Shape legend: P patches of every image of the micro-batch, packed image after image; each image (or clip of up
to max_frames frames) a grid (t, h, w) of 14 x 14 patches, frame-major then row-major; D the tower's width,
H heads of Dh, m the merge factor, Dl the language model's width.

patches [P, C*14*14] -> patch embedding (a bias-free 14 x 14 / stride 14 convolution, as a matmul on the
flattened patch) + the learned position table resized to the image's grid (+ the frame's sin/cos embedding in a
clip) -> blocks of pre-norm RMSNorm, fused wqkv, 2-D rotary q / k, attention over the image's own patches only
(bidirectional; one SDPA per image, no P x P mask), wo; RMSNorm, MLP with tanh GELU -> final norm -> m x m
neighbouring patches concatenated and averaged over frames -> projector (Linear, GELU, Linear to Dl, RMSNorm):
one language-model token per merged block, (h/m)(w/m) per image. Parameter names follow the release's
`vision_tower.*` / `mm_projector.*` (patch_embed.proj, patch_embed.pos_emb, encoder.blocks.N.{norm0, wqkv, wo,
norm1, mlp.fc0, mlp.fc1}, encoder.final_layernorm; proj.0, proj.2, post_norm).

The model class trains this tower from scratch, jointly with the language model, from the first step (its
report: a SigLIP-initialised encoder gave spiky gradient norms), so initial values come from the same
layout-independent draws as every other parameter (model/init.py): projections N(0, init_std), the position
table at the patch embedding's output scale (position_table_std; the release draws N(0, 1), which swamps the
content), norms 1.
"""

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config.model import VisionEncoderConfig
from moe_pretrain.data.patches import Grid
from moe_pretrain.model.init import Normal
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.vision_positions import apply_rope, resized_table, rope_angles, time_embedding
from moe_pretrain.ops.document_attention import document_causal_attention


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, patch_size: int, channels: int, init_std: float,
                 kernels: Kernels = REFERENCES):
        super().__init__()
        self.proj = nn.Conv2d(channels, cfg.hidden_size, patch_size, stride=patch_size, bias=False)
        self.proj.param_init = {"weight": Normal(init_std)}
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.empty(cfg.pos_grid, cfg.pos_grid, cfg.hidden_size))
        self.pos_emb.param_init = {"weight": Normal(position_table_std(patch_size, channels, init_std))}
        self.cfg = cfg

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """[P, C*p*p] (channels outermost within a patch, as data.patches.patchify cuts them) -> [P, D]."""
        x = F.linear(patches, self.proj.weight.flatten(1))
        table = self.pos_emb.weight
        positions = []
        for t, h, w in grids:
            spatial = resized_table(table, h, w, self.cfg.pos_interpolation)
            if t > 1:
                frames = time_embedding(t, table.shape[-1], table.device).to(spatial.dtype)
                spatial = (spatial.unsqueeze(0) + frames.unsqueeze(1)).flatten(0, 1)
            positions.append(spatial)
        return x + torch.cat(positions).to(x.dtype)


def position_table_std(patch_size: int, channels: int, init_std: float) -> float:
    """The position table's initial std: the patch embedding's output std for unit-variance pixels,
    init_std * sqrt(C p p) (0.48 for 3 x 14 x 14 and 0.02), so position and content enter the tower at one
    scale. Drawn at init_std it is far below the content of a coloured patch, and the model learns slowly
    where things are in an image; drawn at N(0, 1) (the release's) it swamps the content (docs/results.md)."""
    return init_std * math.sqrt(channels * patch_size * patch_size)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, init_std: float):
        super().__init__()
        self.fc0 = make_linear(dim, intermediate, init_std=init_std)
        self.fc1 = make_linear(intermediate, dim, init_std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, init_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim
        self.norm0 = RMSNorm(cfg.hidden_size, cfg.norm_eps, kernels)
        self.wqkv = make_linear(cfg.hidden_size, 3 * width, init_std=init_std)
        self.wo = make_linear(width, cfg.hidden_size, init_std=init_std)
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps, kernels)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, init_std)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        attended = document_causal_attention(q, k, v, bounds, self.head_dim ** -0.5, causal=False)
        x = x + self.wo(attended.flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, init_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.blocks = nn.ModuleList([VisionBlock(cfg, init_std, kernels) for _ in range(cfg.num_layers)])
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, kernels)
        self.recompute = False
        """Keep each block's input only and run the block again in backward (any train.recompute but none): at full
        size a block saves ~27K elements per patch, its input 1,024."""

    def forward(self, x: torch.Tensor, angles: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        for block in self.blocks:
            x = maybe_recompute(self.recompute, block, x, angles, bounds)
        return self.final_layernorm(x)


def merge_patches(x_PD: torch.Tensor, grids: list[Grid], m: int) -> torch.Tensor:
    """[P, D] -> [sum (h/m)(w/m), m*m*D]: each m x m block of neighbouring patches, row-major within the block,
    concatenated; a clip's frames averaged."""
    merged, start = [], 0
    for t, h, w in grids:
        image = x_PD[start:start + t * h * w].reshape(t, h // m, m, w // m, m, -1)
        merged.append(image.permute(0, 1, 3, 2, 4, 5).mean(0).flatten(0, 1).flatten(1))
        start += t * h * w
    return torch.cat(merged)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, patch_size: int, channels: int, init_std: float,
                 kernels: Kernels = REFERENCES):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, patch_size, channels, init_std)
        self.encoder = VisionEncoder(cfg, init_std, kernels)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """patches [P, C*p*p] of images with these grids (host integers: the data knows them) -> merged tokens
        [sum (h/m)(w/m), m*m*D]."""
        cfg = self.cfg
        check_grids(grids, patches.shape[0], cfg)
        x = self.patch_embed(patches, grids)
        angles = torch.cat([rope_angles(t, h, w, cfg.head_dim, cfg.rope_theta, x.device) for t, h, w in grids])
        bounds = [0, *itertools.accumulate(t * h * w for t, h, w in grids)]
        return merge_patches(self.encoder(x, angles, bounds), grids, cfg.merge)


def check_grids(grids: list[Grid], patches: int, cfg: VisionEncoderConfig) -> None:
    """Grids must cover the patches and split into whole merge blocks (a clip at most max_frames long)."""
    if sum(t * h * w for t, h, w in grids) != patches:
        raise ValueError(f"vision tower: grids {grids} cover {sum(t * h * w for t, h, w in grids)} patches, "
                         f"not the {patches} given")
    for t, h, w in grids:
        if h % cfg.merge or w % cfg.merge or not 1 <= t <= cfg.max_frames:
            raise ValueError(f"vision tower: grid {(t, h, w)} needs h and w in multiples of "
                             f"model.vision.encoder.merge={cfg.merge} and 1 <= t <= max_frames={cfg.max_frames}")


class VisionProjector(nn.Module):
    """Merged tokens [N, m*m*D] -> Linear, GELU, Linear -> RMSNorm -> [N, Dl] (the release's PatchMergerMLPV2)."""

    def __init__(self, merged_size: int, dim: int, eps: float, init_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.proj = nn.Sequential(make_linear(merged_size, merged_size, init_std=init_std), nn.GELU(),
                                  make_linear(merged_size, dim, init_std=init_std))
        self.post_norm = RMSNorm(dim, eps, kernels)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))
