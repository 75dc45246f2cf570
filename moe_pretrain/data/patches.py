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


def expand_image_tokens(tokens: np.ndarray, patch_counts: list[int], vocab: Vocabulary) -> np.ndarray:
    """Put each image's patch tokens (patch_counts[i] of them) after its IMAGE_START: the token stream of
    a document with images, which needs no pixels (ranks that do not embed images never read them)."""
    if not patch_counts:
        return tokens
    pieces, start = [], 0
    for marker, count in zip(np.flatnonzero(tokens == vocab.image_start), patch_counts):
        pieces += [tokens[start:marker + 1], np.full(count, vocab.image_patch, dtype=np.int64)]
        start = marker + 1
    pieces.append(tokens[start:])
    return np.concatenate(pieces)


def expand_images(tokens: np.ndarray, images: list[np.ndarray], vocab: Vocabulary,
                  patch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens with each image's patch tokens in place, and the patches: pixels (uint8) become [-1, 1]
    floats. -> (tokens, [P, patch_dim] float32 patches or None for a text document)."""
    if not images:
        return tokens, None
    patches = [patchify(image.astype(np.float32) / 127.5 - 1.0, patch_size) for image in images]
    return expand_image_tokens(tokens, [len(p) for p in patches], vocab), np.concatenate(patches)
