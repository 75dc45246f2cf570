"""Expert-parallel token dispatch over an all-to-all, dropless (STYLE.md rule 3).

Shape legend: T local tokens, k experts per token, L latent width, E experts, ep ranks with
E_local = E / ep contiguous experts each (rank r owns experts [r * E_local, (r + 1) * E_local)).

exchange: sort the T * k routed copies by global expert (which is also by destination rank) -> exchange the
per-expert counts -> all_to_all_single the latent rows with uneven splits -> regroup the received blocks
from (source rank, local expert) order into local-expert order -> the experts -> undo the regrouping ->
reverse all-to-all -> weighted sum per token (the local reference's combine). Only latent-width rows travel,
and ranks or experts that receive nothing simply get empty blocks. The tokens may run in chunks whose
exchanges overlap each other's experts (chunk_pipeline.py).
"""

import torch
import torch.distributed as dist

from moe_pretrain.model.token_dispatch import DispatchMetadata, Experts, LocalTokenDispatcher, inverse_order
from moe_pretrain.ops.host_values import READ, HostValues
from parallel.chunk_pipeline import run_interleaved
from parallel.collectives import all_to_all_counts, finish_rows, start_rows
from parallel.fp8_dispatch import FP8_ROWS, row_bytes


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


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    def __init__(self, num_experts: int, group: dist.ProcessGroup, rank: int, *, fused: bool = False,
                 fp8: bool = False, chunks: int = 1, host: HostValues = READ):
        """host: how the split sizes are read (ops/host_values.py)."""
        super().__init__(num_experts, fused=fused)
        self.group, self.host = group, host
        self.size = dist.get_world_size(group)
        self.rank = rank
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split over {self.size} expert-parallel ranks")
        self.num_local_experts = num_experts // self.size
        self.first_local_expert = rank * self.num_local_experts
        self.fp8 = fp8
        self.codec = FP8_ROWS if fp8 else None
        """The dispatch's rows as FP8 (parallel.dispatch_fp8)."""
        self.chunks = chunks
        """The tokens' chunks run as a pipeline (parallel.dispatch_chunks: chunk_pipeline.py)."""
        self.bytes_sent = 0
        """Latent-row bytes this rank sent to other ranks in dispatch (for bench/dispatch.py)."""

    def exchange(self, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        parts = [LocalTokenDispatcher.dispatch(self, *part) for part in
                 zip(*(t.tensor_split(self.chunks) for t in (x_TL, topk_idx, topk_weight)), strict=True)]
        send = torch.stack([counts.reshape(self.size, self.num_local_experts) for _, counts, _ in parts])
        # Every chunk's counts in one exchange and its split sizes in one read of the device: [chunk, rank, expert]
        receive = all_to_all_counts(send.transpose(0, 1).reshape(self.size, -1), self.group)
        receive = receive.reshape(self.size, self.chunks, -1).transpose(0, 1)
        splits = self.host.split_sizes(send, receive, [rows.shape[0] for rows, _, _ in parts], self.rank)
        row = row_bytes(x_TL.shape[1], x_TL.element_size(), self.fp8)
        self.bytes_sent += sum(sum(out) - out[self.rank] for out, _ in splits) * row
        self.rows_received += sum(sum(received) for _, received in splits)
        outputs: list[torch.Tensor | None] = [None] * self.chunks
        run_interleaved(self._chunk(c, parts, receive[c], splits[c], experts, outputs) for c in range(self.chunks))
        return torch.cat(outputs)

    def _chunk(self, c: int, parts: list[tuple[torch.Tensor, torch.Tensor, DispatchMetadata] | None],
               receive_SE: torch.Tensor, splits: tuple[list[int], list[int]],
               experts: Experts, outputs: list[torch.Tensor | None]):
        """One chunk (parts[c]: its sorted rows, counts, local metadata): its rows out to their experts' ranks,
        the experts, their outputs back (a generator that yields with each exchange in flight). It lets go of
        each tensor once it has served, so that a chunk waiting in the pipeline holds no more than the
        unchunked exchange does."""
        sorted_rows, _, local = parts[c]
        parts[c] = None
        send_splits, receive_splits = splits
        out, flight = start_rows(sorted_rows, receive_splits, send_splits, self.group, self.codec)
        del sorted_rows
        yield
        regroup = block_regroup(receive_SE, sum(receive_splits))
        y = experts(finish_rows(out, flight)[regroup], receive_SE.sum(0))
        del out
        back, flight = start_rows(y[inverse_order(regroup)], send_splits, receive_splits, self.group)
        del y
        yield
        outputs[c] = LocalTokenDispatcher.combine(self, finish_rows(back, flight), local)
