"""Image tokens into the embedded sequence, at the positions the image mask marks.

Shape legend: B rows, T positions, D hidden, N image tokens of the batch (row-major), n those a rank encodes.

One rank holds every position: it encodes every image and scatters their tokens into the masked positions
in order. Under tensor or context parallelism the ranks that share rows hold other positions; the parallel
set-up swaps in ImageSplit (parallel/image_split.py), which deals the images over those ranks and sends each
token to the rank holding its position, by overriding the two hooks below.
"""

from collections.abc import Callable

import torch
from torch import nn

from moe_pretrain.data.patches import PlacedImage

Encode = Callable[[list[int]], torch.Tensor]
"""Indices into the batch's images -> their tokens [n, D] in order (the tower and projector)."""


class ImageMerge(nn.Module):
    def forward(self, x_BTD: torch.Tensor, image_mask: torch.Tensor, images: list[PlacedImage], merge: int,
                encode: Encode) -> torch.Tensor:
        """x [B, T', D] the embeddings of the positions this rank holds; image_mask [B, T] marks the images'
        tokens over every position; images placed in row-major order; merge: the tower's spatial merge."""
        tokens_N = sum(image.tokens(merge) for image in images)
        # Checked on the device (a CUDA run raises at its next sync), not by reading the count on the host.
        torch._assert_async(image_mask.sum() == tokens_N, "forward: image_mask must mark exactly the images' tokens")
        which, to_positions = self._deal(images, merge, image_mask.shape[1])
        return x_BTD.masked_scatter(self._held(image_mask).unsqueeze(-1), to_positions(encode(which)))

    def _deal(self, images: list[PlacedImage], merge: int, seq_len: int
              ) -> tuple[list[int], Callable[[torch.Tensor], torch.Tensor]]:
        """(the images this rank encodes, what takes their tokens to the tokens of this rank's positions in
        row-major order): every image, kept as it is."""
        return list(range(len(images))), lambda encoded: encoded

    def _held(self, x_BT: torch.Tensor) -> torch.Tensor:
        """The positions this rank holds of a [B, T] tensor: every one."""
        return x_BT
