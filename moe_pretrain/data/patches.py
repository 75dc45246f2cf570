"""Images to patch tokens: flattened patches, the form the model's patch embedding reads."""

import numpy as np

from moe_pretrain.data.vocabulary import Vocabulary


def patchify(image: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, H, W] -> [(H/p)(W/p), C * p * p]: patches in row-major order, channels outermost within a patch."""
    C, H, W = image.shape
    if H % patch_size or W % patch_size:
        raise ValueError(f"patchify: image {H}x{W} is not divisible into {patch_size}x{patch_size} patches")
    gh, gw = H // patch_size, W // patch_size
    x = image.reshape(C, gh, patch_size, gw, patch_size)
    return x.transpose(1, 3, 0, 2, 4).reshape(gh * gw, C * patch_size * patch_size)


def patches_per_image(image_shape: tuple[int, ...], patch_size: int) -> int:
    _, H, W = image_shape
    return (H // patch_size) * (W // patch_size)


def expand_images(tokens: np.ndarray, images: list[np.ndarray], vocab: Vocabulary,
                  patch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Put each image's patch tokens between its IMAGE_START and IMAGE_END; pixels (uint8) become
    [-1, 1] floats. -> (tokens, [P, patch_dim] float32 patches or None for a text document)."""
    if not images:
        return tokens, None
    patches = [patchify(image.astype(np.float32) / 127.5 - 1.0, patch_size) for image in images]
    pieces, start = [], 0
    for marker, image_patches in zip(np.flatnonzero(tokens == vocab.image_start), patches):
        pieces += [tokens[start:marker + 1], np.full(len(image_patches), vocab.image_patch, dtype=np.int64)]
        start = marker + 1
    pieces.append(tokens[start:])
    return np.concatenate(pieces), np.concatenate(patches)
