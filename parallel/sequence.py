"""Sequence parallelism as an object the model carries (the model itself never calls torch.distributed).

Between the tensor-parallel regions, activations [B, T, D] are split along T over the tensor-parallel
ranks. The model asks this object to scatter the embedded sequence, to gather a tensor it needs whole
(MLA's shared rotary key), and which image patches fall in its shard. NoSequenceParallel is the
single-process identity.
"""

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

    def local_patches(self, patches: torch.Tensor, image_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return patches, image_mask


class SequenceParallel(NoSequenceParallel):
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def scatter(self, x_BTD):
        return scatter_to_sequence_parallel(x_BTD, self.group)

    def gather(self, x_BT_):
        return gather_from_sequence_parallel(x_BT_, self.group)

    def local_patches(self, patches, image_mask):
        """This shard's image_mask [B, T/size] and its patches (patches are in row-major [B, T] order)."""
        T = image_mask.shape[1]
        chunk = T // self.size
        index = (torch.cumsum(image_mask.reshape(-1).long(), 0) - 1).reshape(image_mask.shape)
        local_mask = image_mask[:, self.rank * chunk:(self.rank + 1) * chunk]
        local_index = index[:, self.rank * chunk:(self.rank + 1) * chunk][local_mask]
        return patches[local_index], local_mask
