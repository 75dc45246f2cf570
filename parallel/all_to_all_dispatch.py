"""Expert-parallel token dispatch over an all-to-all, dropless (STYLE.md rule 3).

Shape legend: T local tokens, k experts per token, L latent width, E experts, ep ranks with
E_local = E / ep contiguous experts each (rank r owns experts [r * E_local, (r + 1) * E_local)).

dispatch: sort the T * k routed copies by global expert (which is also by destination rank) ->
exchange the per-expert counts -> all_to_all_single the latent rows with uneven splits -> regroup the
received blocks from (source rank, local expert) order into local-expert order.
combine: undo the regrouping -> reverse all-to-all -> weighted sum per token (the local reference).
Only latent-width rows travel, and ranks or experts that receive nothing simply get empty blocks.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_pretrain.ops.host_values import split_sizes
from parallel.collectives import all_to_all_counts, all_to_all_rows
from parallel.dispatch import DispatchMetadata, LocalTokenDispatcher
from parallel.fp8_dispatch import all_to_all_rows_fp8, row_bytes


@dataclass(frozen=True)
class AllToAllMetadata:
    local: DispatchMetadata
    """The sort of this rank's copies by global expert (undone last, as on one process)."""
    send_splits: list[int]
    """Rows sent to each rank."""
    receive_splits: list[int]
    """Rows received from each rank."""
    regroup: torch.Tensor
    """[R] received-row index of each row in local-expert order."""


def block_regroup(counts_SE: torch.Tensor, total: int) -> torch.Tensor:
    """Rows arrive in (source, expert) blocks of counts_SE[s, e], total of them (known on the host from the
    split sizes, so nothing here reads the device); return the order that lists them by (expert, source)
    instead, as indices into the arrival order."""
    flat = counts_SE.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(counts_SE.shape)
    starts_by_expert = starts.T.reshape(-1)
    counts_by_expert = counts_SE.T.reshape(-1)
    block_start = torch.repeat_interleave(starts_by_expert, counts_by_expert, output_size=total)
    block_offset = torch.arange(total, device=counts_SE.device) - torch.repeat_interleave(
        torch.cumsum(counts_by_expert, 0) - counts_by_expert, counts_by_expert, output_size=total)
    return block_start + block_offset


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (a permutation of its indices)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    def __init__(self, num_experts: int, group: dist.ProcessGroup, rank: int, *, fused: bool = False,
                 fp8: bool = False):
        super().__init__(num_experts, fused=fused)
        self.fp8 = fp8
        self.send_rows = all_to_all_rows_fp8 if fp8 else all_to_all_rows
        """The dispatch's exchange of rows (parallel.dispatch_fp8: as FP8)."""
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = rank
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split over {self.size} expert-parallel ranks")
        self.num_local_experts = num_experts // self.size
        self.first_local_expert = rank * self.num_local_experts
        self.bytes_sent = 0
        """Latent-row bytes this rank sent to other ranks in dispatch (for bench/dispatch.py)."""

    def dispatch(self, x_TL, topk_idx, topk_weight):
        sorted_rows, counts_E, local_meta = super().dispatch(x_TL, topk_idx, topk_weight)
        send_counts = counts_E.reshape(self.size, self.num_local_experts)
        receive_counts = all_to_all_counts(send_counts, self.group)  # [source rank, local expert]
        # all_to_all_single takes its split sizes on the host: the dispatch's one read of the device.
        send_splits, receive_splits = split_sizes(send_counts, receive_counts, sorted_rows.shape[0], self.rank)
        self.bytes_sent += (sum(send_splits) - send_splits[self.rank]) * row_bytes(x_TL, self.fp8)
        received = self.send_rows(sorted_rows, receive_splits, send_splits, self.group)
        regroup = block_regroup(receive_counts, sum(receive_splits))
        meta = AllToAllMetadata(local_meta, send_splits, receive_splits, regroup)
        return received[regroup], receive_counts.sum(0), meta

    def combine(self, y_grouped, meta):
        returned = all_to_all_rows(y_grouped[inverse_order(meta.regroup)], meta.send_splits, meta.receive_splits,
                                   self.group)
        return super().combine(returned, meta.local)
