"""Where a patch sits, for the vision tower: a learned table resized to each image's patch grid, a sin/cos
embedding of the frame index of a clip, and 2-D rotary angles (MoonViT's, as the model class's report and
its public loaders describe them).

Shape legend: a grid (t, h, w) is t frames of h x w patches, flattened frame-major then row-major (patch
(f, i, j) at row f*h*w + i*w + j); D the tower's width, Dh its head dim.
"""

import torch
import torch.nn.functional as F

from moe_pretrain.ops.norms import compute_dtype


def resized_table(table_GGD: torch.Tensor, h: int, w: int, mode: str) -> torch.Tensor:
    """The learned [G, G, D] position table resized to an h x w grid -> [h*w, D] (the table itself at G x G)."""
    if (h, w) == tuple(table_GGD.shape[:2]):
        return table_GGD.flatten(0, 1)
    resized = F.interpolate(table_GGD.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode=mode, align_corners=False)
    return resized[0].permute(1, 2, 0).flatten(0, 1)


def time_embedding(frames: int, dim: int, device: torch.device) -> torch.Tensor:
    """[frames, dim] sin/cos of the frame index (sines in the first half, cosines in the second; frequencies
    10000^(-2i/dim)), added to every patch of its frame when a clip has more than one."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    angles = torch.arange(frames, dtype=torch.float64, device=device).unsqueeze(1) * omega
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def rope_angles(t: int, h: int, w: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[t*h*w, Dh/2] rotation angles, pairs interleaved: pair 2i turns with the column (x) at frequency
    theta^(-4i/Dh), pair 2i+1 with the row (y) at the same frequency; every frame of a clip alike."""
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float64, device=device)[: head_dim // 4] / head_dim)
    rows = torch.arange(h, dtype=torch.float64, device=device).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float64, device=device).repeat(h)
    angles = torch.stack([cols.unsqueeze(1) * freqs, rows.unsqueeze(1) * freqs], dim=2).flatten(1)  # [h*w, Dh/2]
    return angles.repeat(t, 1)


def apply_rope(x_NHD: torch.Tensor, angles_ND: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2k], x[2k+1]) of every head by angles[:, k]; in >= fp32, back to x's dtype."""
    dtype = compute_dtype(x_NHD.dtype)
    pairs = x_NHD.to(dtype).unflatten(-1, (-1, 2))
    cos, sin = angles_ND.cos().to(dtype).unsqueeze(1), angles_ND.sin().to(dtype).unsqueeze(1)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x_NHD.dtype)
