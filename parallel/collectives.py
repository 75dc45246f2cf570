"""Collectives as named autograd functions, each paired with its backward dual (megatron mappings style).

Every function takes an explicit process group; with group None (a single process) it is the identity.
"""

import torch
import torch.distributed as dist

from parallel.torch_compat import all_gather_single, reduce_scatter_single


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; the backward sends gradients back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send input_splits[r] rows of x to rank r; receive output_splits[r] rows from rank r (differentiable)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """counts [size, n]: row r goes to rank r; returns [size, n] whose row r came from rank r (no grad)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group into a new tensor (no grad)."""
    if group_size(group) == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def gather_objects(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable obj, in rank order, on every rank ([obj] without a group). For small per-rank
    reports (failures, file lists, bench rows), never per-step state."""
    if group_size(group) == 1:
        return [obj]
    objects: list = [None] * group_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


# Sequence-parallel mappings over dimension 1 of [B, T, ...] activations (megatron-core's
# gather_from / reduce_scatter_to / scatter_to_sequence_parallel_region, device-agnostic).


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    x_T = x.transpose(0, 1).contiguous()
    out = x_T.new_empty(x_T.shape[0] * size, *x_T.shape[1:])
    all_gather_single(out, x_T, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    x_T = x.transpose(0, 1).contiguous()
    if x_T.shape[0] % size:
        raise ValueError(f"sequence length {x_T.shape[0]} is not divisible by the {size} sequence-parallel ranks")
    out = x_T.new_empty(x_T.shape[0] // size, *x_T.shape[1:])
    reduce_scatter_single(out, x_T, group=group)
    return out.transpose(0, 1)


def _split_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the {size} sequence-parallel ranks")
    chunk = x.shape[1] // size
    return x[:, rank * chunk:(rank + 1) * chunk].contiguous()


def _paired(name: str, forward, backward, doc: str) -> type[torch.autograd.Function]:
    """An autograd function whose backward is the dual collective of its forward (same group)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                    "__doc__": doc})


_GatherFromSequenceParallel = _paired(
    "_GatherFromSequenceParallel", _gather_seq, _reduce_scatter_seq,
    "Forward: all-gather the sequence shards. Backward: reduce-scatter (each rank's use was partial).")
_ReduceScatterToSequenceParallel = _paired(
    "_ReduceScatterToSequenceParallel", _reduce_scatter_seq, _gather_seq,
    "Forward: sum partial results and keep this rank's sequence shard. Backward: all-gather.")
_ScatterToSequenceParallel = _paired(
    "_ScatterToSequenceParallel", _split_seq, _gather_seq,
    "Forward: keep this rank's shard of a replicated sequence. Backward: all-gather the gradient.")


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallel.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequenceParallel.apply(x, group)


def _gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty(size * x.numel())  # flat: gloo accepts the concatenated form only
    all_gather_single(out, x.reshape(-1).contiguous(), group=group)
    return out.view(size, *x.shape)


def _reduce_scatter_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(x[0].numel())
    reduce_scatter_single(out, x.reshape(-1).contiguous(), group=group)
    return out.view(x.shape[1:])


_AllGatherStacked = _paired(
    "_AllGatherStacked", _gather_stacked, _reduce_scatter_stacked,
    "Forward: every rank's tensor, stacked along a new dim 0. Backward: each rank's piece gets the sum of "
    "the gradients every rank computed for it.")


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[*shape] -> [group size, *shape], row r from rank r (differentiable)."""
    return x.unsqueeze(0) if group_size(group) == 1 else _AllGatherStacked.apply(x, group)
