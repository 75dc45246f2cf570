"""Images to flattened patches, the form the model's patch embedding reads."""

import numpy as np


def patchify(image: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, S, S] -> [(S/p)^2, C * p * p]: patches in row-major order, channels outermost within a patch."""
    C, S, S2 = image.shape
    if S != S2 or S % patch_size:
        raise ValueError(f"patchify: image {S}x{S2} is not square with a side divisible by {patch_size}")
    g = S // patch_size
    x = image.reshape(C, g, patch_size, g, patch_size)
    return x.transpose(1, 3, 0, 2, 4).reshape(g * g, C * patch_size * patch_size)
