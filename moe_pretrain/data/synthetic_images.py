"""Procedurally generated images with matching captions: the default multimodal data.

Each image is a mid-grey noisy canvas split into a 2 x 2 grid of cells; one or two cells hold a coloured
shape. The caption names colour, shape and cell ("a red circle in the top left"), so the caption is
predictable only by looking at the patches. Images come in four sizes, S x S, S x S/2, S/2 x S and
S/2 x S/2 (native resolution: the tower sees each at its own size). Deterministic from (seed, index).
"""

import numpy as np

COLOURS = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.2, 0.3, 1.0), "yellow": (1.0, 0.9, 0.1),
    "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9), "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "cross")
CELLS = ("top left", "top right", "bottom left", "bottom right")


def image_size(seed: int, index: int, side: int) -> tuple[int, int]:
    """(H, W) of image `index`: side or side / 2 each, drawn from (seed, index)."""
    rng = np.random.default_rng([seed, index, 1])
    return side // (1 + int(rng.integers(2))), side // (1 + int(rng.integers(2)))


def _shape_mask(shape: str, height: int, width: int) -> np.ndarray:
    """Boolean [height, width] mask of a shape filling most of a cell (sized by its shorter side)."""
    size = min(height, width)
    y, x = np.mgrid[0:height, 0:width] + 0.5
    y, x = y - (height - size) / 2, x - (width - size) / 2
    c, r = size / 2, size * 0.38
    if shape == "square":
        return (abs(x - c) <= r) & (abs(y - c) <= r)
    if shape == "circle":
        return (x - c) ** 2 + (y - c) ** 2 <= r**2
    if shape == "triangle":
        top, bottom = c - r, c + r
        half_width = (y - top) / (bottom - top) * r
        return (y >= top) & (y <= bottom) & (abs(x - c) <= half_width)
    arm = max(size * 0.1, 1.0)
    return ((abs(x - c) <= arm) & (abs(y - c) <= r)) | ((abs(y - c) <= arm) & (abs(x - c) <= r))


def make_image(seed: int, index: int, side: int, channels: int = 3) -> tuple[np.ndarray, str]:
    """-> (image [channels, H, W] float32 in [-1, 1] (H, W = image_size(seed, index, side)), caption)."""
    if channels != 3:
        raise ValueError(f"synthetic images are RGB: model.vision.channels must be 3, got {channels}")
    height, width = image_size(seed, index, side)
    rng = np.random.default_rng([seed, index])
    # Mid-grey, like a normalised photograph (pixels around 0 once scaled to [-1, 1]). A dark canvas puts one
    # large offset into every patch, which the bias-free patch embedding and the RMSNorms carry into every image
    # token, so that the tower tells images apart slowly (docs/results.md).
    canvas = rng.uniform(0.35, 0.65, size=(3, height, width)).astype(np.float32)
    cell_h, cell_w = height // 2, width // 2
    count = 1 + int(rng.random() < 0.4)  # one shape or two
    cells = rng.choice(len(CELLS), size=count, replace=False)
    phrases = []
    for cell_index in sorted(cells):
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        row, col = divmod(int(cell_index), 2)
        mask = _shape_mask(shape, cell_h, cell_w)
        region = canvas[:, row * cell_h:(row + 1) * cell_h, col * cell_w:(col + 1) * cell_w]
        for ch, value in enumerate(COLOURS[colour]):
            region[ch][mask] = value
        phrases.append(f"a {colour} {shape} in the {CELLS[cell_index]}")
    return canvas * 2.0 - 1.0, " and ".join(phrases) + "."
