"""Images to the vision tower's input: 14 x 14 patches on each image's own grid, and the token stream the
language model sees (one image token per merged block of merge x merge patches).

Shape legend: an image is uint8 [C, H, W], a clip [t, C, H, W] (t frames of one size); p the patch side, m the
merge factor; its grid (t, h, w) = (t, H/p, W/p) patches, flattened frame-major then row-major (the order
model/vision_tower.py reads); it becomes (h/m)(w/m) language-model tokens.
"""

from dataclasses import dataclass

import numpy as np

from moe_pretrain.data.vocabulary import Vocabulary

Grid = tuple[int, int, int]
"""(frames t, patch rows h, patch columns w) of one image or clip."""


@dataclass(frozen=True)
class PlacedImage:
    """One image of a micro-batch and where its tokens go: (h/m)(w/m) positions from `start` in row `row`."""

    row: int
    start: int
    grid: Grid

    def tokens(self, merge: int) -> int:
        _, h, w = self.grid
        return (h // merge) * (w // merge)

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def placed_images(grids: list[list[Grid]], starts: list[list[int]]) -> list[PlacedImage]:
    """Rows' image grids and first token positions (data.Batch's) -> the images in row-major order."""
    return [PlacedImage(row, start, tuple(grid))
            for row, (row_grids, row_starts) in enumerate(zip(grids, starts, strict=True))
            for grid, start in zip(row_grids, row_starts, strict=True)]


def as_clip(image: np.ndarray) -> np.ndarray:
    """[C, H, W] -> [1, C, H, W]; a clip [t, C, H, W] as it is."""
    return image[None] if image.ndim == 3 else image


def image_grid(shape: tuple[int, ...], patch_size: int) -> Grid:
    """The patch grid of an image of shape [C, H, W] or a clip [t, C, H, W] (sides multiples of patch_size)."""
    t, _, H, W = (1, *shape) if len(shape) == 3 else shape
    return t, H // patch_size, W // patch_size


def image_tokens(grid: Grid, merge: int) -> int:
    """Language-model tokens an image of this grid becomes: one per merge x merge block (frames averaged)."""
    _, h, w = grid
    return (h // merge) * (w // merge)


def patchify(image: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, H, W] or [t, C, H, W] -> [t (H/p)(W/p), C p p]: frame-major, row-major, channels outermost within a
    patch (the layout a bias-free p x p / stride p convolution's weight, flattened, multiplies)."""
    clip = as_clip(image)
    t, C, H, W = clip.shape
    if H % patch_size or W % patch_size:
        raise ValueError(f"patchify: image {H}x{W} is not divisible into {patch_size}x{patch_size} patches")
    gh, gw = H // patch_size, W // patch_size
    x = clip.reshape(t, C, gh, patch_size, gw, patch_size)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(t * gh * gw, C * patch_size * patch_size)


def expand_image_tokens(tokens: np.ndarray, token_counts: list[int], vocab: Vocabulary) -> np.ndarray:
    """Put each image's tokens (token_counts[i] IMAGE_PATCH ids) after its IMAGE_START: the token stream of
    a document with images, which needs no pixels (ranks that do not embed images never read them)."""
    if not token_counts:
        return tokens
    pieces, start = [], 0
    for marker, count in zip(np.flatnonzero(tokens == vocab.image_start), token_counts):
        pieces += [tokens[start:marker + 1], np.full(count, vocab.image_patch, dtype=np.int64)]
        start = marker + 1
    pieces.append(tokens[start:])
    return np.concatenate(pieces)


def expand_images(tokens: np.ndarray, images: list[np.ndarray], vocab: Vocabulary, patch_size: int,
                  merge: int) -> tuple[np.ndarray, np.ndarray | None, list[Grid]]:
    """Tokens with each image's tokens in place, its patches and grids: pixels (uint8) become [-1, 1] floats.
    -> (tokens, [P, C p p] float32 patches or None for a text document, one grid per image)."""
    if not images:
        return tokens, None, []
    grids = [image_grid(image.shape, patch_size) for image in images]
    patches = [patchify(image.astype(np.float32) / 127.5 - 1.0, patch_size) for image in images]
    return (expand_image_tokens(tokens, [image_tokens(g, merge) for g in grids], vocab), np.concatenate(patches),
            grids)
