"""A rank's piece of a tensor as a list of boxes, saved and loaded by torch.distributed.checkpoint in place.

ZeRO-1 gives each rank a contiguous range of a flat bucket, which cuts parameters at arbitrary elements,
so a rank's part of a parameter's Adam moment is a flat range of that parameter, not a DTensor shard. A flat
range [start, stop) of a row-major tensor is a union of at most 2 x ndim - 1 boxes (a partial row, whole
rows, a partial row, recursively), each contiguous in memory. Stored as DCP chunks of the global tensor,
they need no gathering at save (nothing is duplicated) and load into any other layout's boxes: keys and
global shapes are those of the parameter, as for the parameters themselves.
"""

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box."""


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes, in flat order, covering elements [start, stop) of a row-major tensor of `shape`."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    first, last = start // inner, (stop - 1) // inner
    if first == last and (start % inner or stop % inner):
        return in_row(first, start - first * inner, stop - first * inner)
    boxes, whole_from = [], first
    if start % inner:
        boxes += in_row(first, start - first * inner, inner)
        whole_from = first + 1
    whole_to = stop // inner
    if whole_to > whole_from:
        boxes.append(((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if stop % inner:
        boxes += in_row(whole_to, 0, stop - whole_to * inner)
    return boxes


@dataclass
class BoxedTensor:
    """This rank's boxes of a global tensor: (global offsets, contiguous view holding the box)."""

    global_size: torch.Size
    boxes: list[tuple[tuple[int, ...], torch.Tensor]]

    @classmethod
    def from_flat_range(cls, global_size: tuple[int, ...], local_shape: tuple[int, ...],
                        local_offsets: tuple[int, ...], start: int, flat: torch.Tensor) -> "BoxedTensor":
        """flat holds elements [start, start + len(flat)) of this rank's local block (shape local_shape,
        placed at local_offsets in the global tensor)."""
        boxes, position = [], 0
        for offsets, sizes in flat_range_boxes(local_shape, start, start + flat.numel()):
            count = math.prod(sizes)
            view = flat[position:position + count].view(sizes)
            boxes.append((tuple(o + g for o, g in zip(offsets, local_offsets)), view))
            position += count
        return cls(torch.Size(global_size), boxes)

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                              properties=TensorProperties.create_from_tensor(view), size=self.global_size))
                for offsets, view in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape) for offsets, view in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no box at offset {index.offset} on this rank")


def storage_exact_alias(tensor: torch.Tensor) -> torch.Tensor:
    """The same CPU memory as a tensor whose storage is exactly its bytes (no copy).

    DCP's file writer clones a tensor whose storage is larger than itself (a view) and keeps every tensor
    of a file until the file is closed (torch 2.13, filesystem.py), so the views this project saves (the
    parameters and moments live in flat buffers) would add up to a second copy of the state at every save.
    An alias whose storage is its own bytes is written as it is."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.untyped_storage().nbytes() == tensor.nbytes or tensor.dtype == torch.bfloat16):
        return tensor
    return torch.from_numpy(tensor.detach().numpy())


class BoxedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds BoxedTensor boxes, and hands views over without copies."""

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.__get_tensor_shard__(index) if isinstance(value, BoxedTensor) else super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem):
        data = super().resolve_data(write_item)
        return storage_exact_alias(data) if isinstance(data, torch.Tensor) else data


class BoxedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which loads into BoxedTensor boxes in place. (Its set-up replaces values
    it does not know by None, so the boxed ones are set aside and put back.)"""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        boxed = {key: value for key, value in state_dict.items() if isinstance(value, BoxedTensor)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in boxed}, metadata, is_coordinator)
        self.state_dict.update(boxed)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.__get_tensor_shard__(index) if isinstance(value, BoxedTensor) else super().lookup_tensor(index)
