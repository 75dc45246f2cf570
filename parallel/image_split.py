"""Which rank encodes each image of a micro-batch, and how its tokens reach the ranks that hold their positions.

Shape legend: N image tokens of the micro-batch (row-major), n those this rank encodes or receives, D the
language model's width; a tp x cp block: the tensor- and context-parallel ranks that share rows.

One process (or a block of one rank) encodes every image and keeps every token. In a block of several ranks
every rank holds the same rows but other positions, and encoding every image on every rank would repeat the
tower tp x cp times: at the 1M stage (cp 64, tp 4) a row full of 3584 x 3584 images saves ~1.6 TB of the
tower's activations on each rank (planning/step_activations.py), against ~6 GB when the block shares the work.
So the images are dealt over the block (largest first to the least loaded rank, by patches: the same deal on
every rank, from host integers), each rank encodes its own, and each token travels to the rank holding its
position: one all-to-all over the context-parallel group (ranks of one tensor rank) to the cp rank that holds
the position, then one over the tensor-parallel group to the rank whose sequence shard holds it; the
backward returns the gradients the same way. Every rank's tower then has the gradients of its own images, and
the tensor x data (x context) reduce of replicated parameters (parallel/plan.py) sums them.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from moe_pretrain.data.patches import PlacedImage
from moe_pretrain.model.image_merge import ImageMerge
from parallel.collectives import all_to_all_rows
from parallel.context_parallel import NoContextParallel
from parallel.sequence import NoSequenceParallel


def deal(sizes: list[int], ranks: int) -> np.ndarray:
    """Each item's rank: largest first to the least loaded (ties: the lower rank, then the earlier item)."""
    load = np.zeros(ranks, dtype=np.int64)
    owner = np.zeros(len(sizes), dtype=np.int64)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[item] = int(np.argmin(load))
        load[owner[item]] += sizes[item]
    return owner


@dataclass(frozen=True)
class _Route:
    """This rank's part of the exchange, in host integers: the images it encodes; the order it sends its
    tokens in and the split sizes of the cp all-to-all; the same for the tp all-to-all; the order that puts
    what it received into its local positions' order."""

    encoded: list[int]
    cp_order: np.ndarray | None
    cp_send: list[int]
    cp_receive: list[int]
    tp_order: np.ndarray | None
    tp_send: list[int]
    tp_receive: list[int]
    local_order: np.ndarray | None
    """None: the rows as they come (a block of one rank)."""


class ImageSplit(ImageMerge):
    """The image merge of a rank in a block of several: the block's deal of images and the token exchange
    (module docstring). `context` and `sequence` are the rows' context- and sequence-parallel splits (sizes 1
    included): each tells which of its ranks holds a position and where it sits in that rank's shard (`place`)."""

    context: NoContextParallel
    sequence: NoSequenceParallel

    def __init__(self, context: NoContextParallel, sequence: NoSequenceParallel):
        super().__init__()
        self.context, self.sequence = context, sequence

    @property
    def cp(self) -> int:
        return self.context.size

    @property
    def tp(self) -> int:
        return self.sequence.size

    @property
    def slot(self) -> int:
        """This rank's place in the block."""
        return self.context.rank * self.tp + self.sequence.rank

    def _deal(self, images: list[PlacedImage], merge: int, seq_len: int
              ) -> tuple[list[int], Callable[[torch.Tensor], torch.Tensor]]:
        route = self.route(images, merge, seq_len)
        return route.encoded, functools.partial(self.exchange, route=route)

    def _held(self, x_BT: torch.Tensor) -> torch.Tensor:
        return self.sequence.local(self.context.local(x_BT))

    def route(self, images: list[PlacedImage], merge: int, seq_len: int) -> _Route:
        """The exchange for these images (the same on every rank of the block: each computes every rank's
        part from the same host integers and keeps its own)."""
        if self.cp * self.tp == 1:  # one rank encodes every image and holds every position, in order
            tokens = [sum(image.tokens(merge) for image in images)]
            return _Route(list(range(len(images))), None, tokens, tokens, None, tokens, tokens, None)
        owner = deal([image.patches for image in images], self.cp * self.tp)
        counts = np.array([image.tokens(merge) for image in images], dtype=np.int64)
        image_of = np.repeat(np.arange(len(images)), counts)  # each token's image, tokens in row-major order
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        offset = np.arange(int(counts.sum())) - first[image_of]
        rows = np.array([image.row for image in images], dtype=np.int64)[image_of]
        positions = np.array([image.start for image in images], dtype=np.int64)[image_of] + offset
        hold_c, local = self.context.place(positions, seq_len)
        local_len = seq_len // self.cp
        hold_s, shard_index = self.sequence.place(local, local_len)
        key = rows * (local_len // self.tp) + shard_index  # order among the holder's positions
        slot = owner[image_of]
        enc_c, enc_s = slot // self.tp, slot % self.tp
        c, s = self.context.rank, self.sequence.rank
        tokens = np.arange(len(image_of))
        mine = tokens[slot == self.slot]  # in the tower's output order: its images in order, tokens in order
        # cp all-to-all among the ranks of tensor rank s: each token to the cp rank holding its position.
        cp_order = np.argsort(hold_c[mine], kind="stable")
        received_a = tokens[(enc_s == s) & (hold_c == c)]
        received_a = received_a[np.lexsort((received_a, enc_c[received_a]))]  # by source, then token
        # tp all-to-all among the ranks of cp rank c: each token to the tensor rank whose shard holds it.
        tp_order = np.argsort(hold_s[received_a], kind="stable")
        received_b = tokens[(hold_c == c) & (hold_s == s)]
        received_b = received_b[np.lexsort((received_b, enc_c[received_b], enc_s[received_b]))]
        return _Route(
            np.flatnonzero(owner == self.slot).tolist(),
            cp_order, np.bincount(hold_c[mine], minlength=self.cp).tolist(),
            np.bincount(enc_c[received_a], minlength=self.cp).tolist(),
            tp_order, np.bincount(hold_s[received_a], minlength=self.tp).tolist(),
            np.bincount(enc_s[received_b], minlength=self.tp).tolist(),
            np.argsort(key[received_b], kind="stable"))

    def exchange(self, encoded_nD: torch.Tensor, route: _Route) -> torch.Tensor:
        """This rank's encoded tokens [n, D] (its images' tokens in order) -> the tokens of its own positions
        [n', D], in their row-major order (differentiable: gradients go back to the encoding ranks)."""
        x = encoded_nD
        if self.cp > 1:
            x = all_to_all_rows(_take(x, route.cp_order), route.cp_receive, route.cp_send, self.context.group)
        if self.tp > 1:
            x = all_to_all_rows(_take(x, route.tp_order), route.tp_receive, route.tp_send, self.sequence.group)
        return _take(x, route.local_order)


def _take(x: torch.Tensor, order: np.ndarray | None) -> torch.Tensor:
    """Rows of x in `order` (a host permutation; None or the identity costs nothing)."""
    if order is None or np.array_equal(order, np.arange(len(order))):
        return x
    return x.index_select(0, torch.as_tensor(order, device=x.device))


def place_image_merge(module: nn.Module, sequence: NoSequenceParallel, context: NoContextParallel) -> None:
    """The model's image merge as the splits ask: ImageSplit in a block of several ranks, else the plain merge."""
    if context.size * sequence.size > 1:
        module.__class__ = ImageSplit
        module.context, module.sequence = context, sequence
    else:
        module.__class__ = ImageMerge
        for name in ("context", "sequence"):
            module.__dict__.pop(name, None)
