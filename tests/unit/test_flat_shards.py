"""Flat ranges as boxes: every range of every shape is covered exactly, in flat order, by contiguous boxes."""

import itertools
import math

import pytest
import torch

from parallel.flat_shards import BoxedTensor, flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 4), (4, 1, 3)])
def test_boxes_cover_each_range_in_flat_order(shape):
    numel = math.prod(shape)
    whole = torch.arange(numel).reshape(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1
        pieces = [whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                  for offsets, sizes in boxes]
        assert torch.equal(torch.cat(pieces), torch.arange(start, stop)), (start, stop, boxes)


def test_boxed_tensor_views_a_flat_slice_of_a_shifted_block():
    flat = torch.arange(10.0)
    boxed = BoxedTensor.from_flat_range((4, 6), (2, 6), (2, 0), 3, flat[:7])  # elements 3..9 of the block
    assert [(offsets, tuple(view.shape)) for offsets, view in boxed.boxes] == [((2, 3), (1, 3)), ((3, 0), (1, 4))]
    boxed.boxes[0][1].fill_(-1)
    assert torch.equal(flat[:3], torch.full((3,), -1.0))  # a view, not a copy
    assert sum(view.numel() for _, view in boxed.boxes) == 7 and boxed.size() == torch.Size((4, 6))


def test_boxes_save_and_load_into_other_ranges(tmp_path):
    """Saved as two ranks' ranges (3 + 9 elements of a [3, 4] tensor), loaded as other ranges (in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from parallel.flat_shards import BoxedLoadPlanner, BoxedSavePlanner

    values = torch.arange(12.0)
    for start, stop, part in ((0, 3, "a"), (3, 12, "b")):
        state = {"m": BoxedTensor.from_flat_range((3, 4), (3, 4), (0, 0), start, values[start:stop])}
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path / part), planner=BoxedSavePlanner(), no_dist=True)
    # Two saves of two halves are two checkpoints: merge their metadata by loading each piece where it lies.
    target = torch.zeros(12)
    for part, (start, stop) in (("a", (0, 3)), ("b", (5, 11))):
        state = {"m": BoxedTensor.from_flat_range((3, 4), (3, 4), (0, 0), start, target[start:stop])}
        dcp.load(state, storage_reader=FileSystemReader(tmp_path / part), planner=BoxedLoadPlanner(), no_dist=True)
    expected = torch.zeros(12)
    expected[0:3], expected[5:11] = values[0:3], values[5:11]
    assert torch.equal(target, expected)


def test_storage_exact_alias_shares_memory_without_the_rest_of_the_buffer():
    from parallel.flat_shards import storage_exact_alias

    flat = torch.zeros(100)
    view = flat[10:30].view(4, 5)
    alias = storage_exact_alias(view)
    assert alias.untyped_storage().nbytes() == view.nbytes and torch.equal(alias, view)
    alias.fill_(2.0)
    assert flat[10:30].eq(2.0).all() and flat[:10].eq(0).all()
