"""The size an image is trained at: its own aspect ratio, each side a multiple of patch x merge (28 for the
model class), no larger than a pixel budget. Preprocess stores images at this size for its budget
(`--max-image-pixels`), and the loader shrinks a stored image further where a run's budget
(`data.max_image_pixels`) is smaller, by the same rule, so the token count of every image is known from
its stored shape alone (the packer plans rows from lengths, never from pixels).
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

from moe_pretrain.config import Config

RELEASE_MAX_PIXELS = 3584 * 3584
"""The model class's largest image (its release's vision config: 3584 x 3584 pixels, 16,384 tokens)."""


def fitted_size(height: int, width: int, max_pixels: int, multiple: int) -> tuple[int, int]:
    """(H, W) of an image fitted to the budget: each side rounded to the nearest multiple of `multiple` (at
    least one), then, if the area still exceeds max_pixels, both sides scaled by one factor and floored to
    multiples until it fits. An image already on the grid and within budget keeps its size."""
    if height <= 0 or width <= 0:
        raise ValueError(f"an image of {height} x {width} pixels has no area")
    if max_pixels < multiple * multiple:
        raise ValueError(f"a budget of {max_pixels} pixels holds no {multiple} x {multiple} block")
    h = max(multiple, round(height / multiple) * multiple)
    w = max(multiple, round(width / multiple) * multiple)
    if h * w <= max_pixels:
        return h, w
    scale = math.sqrt(max_pixels / (height * width))
    h = max(multiple, math.floor(height * scale / multiple) * multiple)
    w = max(multiple, math.floor(width * scale / multiple) * multiple)
    if h * w > max_pixels:  # a side held at `multiple` by the floor: the other gives way
        if h >= w:
            h = max_pixels // w // multiple * multiple
        else:
            w = max_pixels // h // multiple * multiple
    return h, w


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [C, H, W] or [t, C, H, W] -> the same at height x width (antialiased bicubic, as Pillow's
    resize; rounded back to uint8). The identity when the size already matches."""
    if image.shape[-2:] == (height, width):
        return image
    frames = torch.from_numpy(np.ascontiguousarray(image)).reshape(-1, *image.shape[-3:]).to(torch.float32)
    resized = F.interpolate(frames, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    out = resized.round().clamp(0, 255).to(torch.uint8).numpy()
    return out.reshape(*image.shape[:-2], height, width)


def default_max_pixels(seq_len: int, patch_size: int, merge: int) -> int:
    """data.max_image_pixels when unset: the release's maximum, or less where a row of seq_len tokens is
    short: an image then takes at most half a row (the rest for its text), so no image alone fills a row."""
    block = (patch_size * merge) ** 2
    return min(RELEASE_MAX_PIXELS, max(1, seq_len // 2) * block)


def run_max_pixels(cfg: Config) -> int:
    """The run's image budget: data.max_image_pixels, else the default for its shortest rows (every stage reads
    the same stored images, so one budget serves the run and token counts stay fixed across stages)."""
    vision = cfg.model.vision
    shortest = min(s.seq_len for s in cfg.stages) if cfg.stages else cfg.data.seq_len
    return cfg.data.max_image_pixels or default_max_pixels(shortest, vision.patch_size, vision.encoder.merge)
