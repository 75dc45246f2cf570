"""Sequence parallelism: between the tensor-parallel regions, activations [B, T, D] are split along T.

The activation plan (parallel/activation_plan.py) uses this split to scatter the embedded sequence, MLA's
sequence-parallel variants to gather a tensor they need whole (the shared rotary key), and the image split to
find where a position lives (its shard of a mask; which rank holds an image token). NoSequenceParallel is
the one-rank identity.
"""

import numpy as np
import torch
import torch.distributed as dist

from parallel.collectives import gather_from_sequence_parallel, scatter_to_sequence_parallel


class NoSequenceParallel:
    size = 1
    rank = 0

    def scatter(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_

    def local(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> this rank's shard [B, T / size, ...] (no communication)."""
        return x_BT_

    def place(self, positions: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Host positions in sequences of seq_len -> (the rank holding each, its index in that rank's shard)."""
        return np.zeros_like(positions), positions


class SequenceParallel(NoSequenceParallel):
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def scatter(self, x_BTD):
        return scatter_to_sequence_parallel(x_BTD, self.group)

    def gather(self, x_BT_):
        return gather_from_sequence_parallel(x_BT_, self.group)

    def local(self, x_BT_):
        chunk = x_BT_.shape[1] // self.size
        return x_BT_[:, self.rank * chunk:(self.rank + 1) * chunk]

    def place(self, positions, seq_len):
        chunk = seq_len // self.size
        return positions // chunk, positions % chunk
