"""Expert-parallel dispatch that sends each token once per node (hierarchical, DeepEP's idea in collectives).

Shape legend: T local tokens, k experts per token, L latent width, E experts over ep ranks (E_local each),
the ep ranks laid out as N nodes x G ranks (ep rank s on node s // G, local index s % G).

The flat dispatcher (all_to_all_dispatch.py) sends one row per routed copy: a token whose k experts sit on
four GPUs of one remote node crosses that node's NIC four times. Here a token crosses it once:
1. rail exchange (ranks of the same local index on every node, one per node: each pair crosses the NIC):
   each token goes once to every node holding one of its experts, with its k expert ids (-1 where the
   expert is on another node) and its k routing weights;
2. node exchange (the G ranks of one node, over NVLink): the forwarding rank fans each row out to the
   ranks of its node holding the row's experts, one row per copy, grouped by local expert as the flat
   dispatcher delivers them.
combine runs it backwards: the node exchange returns each copy's expert output to the forwarding rank,
which sums a token's copies with their weights (one partial row per token and node), and the rail
exchange returns those partials, which the token's own rank adds up. The weights travel, so the router's
gradient flows back through the rail exchange. Every exchange's split sizes come from one host read.
"""

import torch
import torch.distributed as dist

from moe_pretrain.model.token_dispatch import Experts, LocalTokenDispatcher, inverse_order
from moe_pretrain.ops.host_values import READ, HostValues
from moe_pretrain.ops.routing import expert_load
from parallel.all_to_all_dispatch import block_regroup
from parallel.chunk_pipeline import run_interleaved
from parallel.collectives import all_to_all_counts, all_to_all_rows, finish_rows, group_size, start_rows
from parallel.fp8_dispatch import FP8_ROWS, row_bytes


class _SumRows(torch.autograd.Function):
    """rows [R, L] summed into n rows, row r into index[r] (index_add), keeping only the index for the
    backward: torch's index_add keeps its source too, all of a layer's k L-wide weighted copies."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return rows.new_zeros(n, rows.shape[1]).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class NodeTokenDispatcher(LocalTokenDispatcher):
    """ep ranks as N nodes of G (rail_group: this rank's peers of the same local index, one per node, in node
    order; node_group: the G ranks of this node, in local order)."""

    permutes = False  # rows are gathered by index (token_of_row, row_of_copy), never permuted

    def __init__(self, num_experts: int, rank: int, rail_group: dist.ProcessGroup | None,
                 node_group: dist.ProcessGroup | None, *, fused: bool = False, fp8: bool = False, chunks: int = 1,
                 host: HostValues = READ):
        """host: how the split sizes are read (ops/host_values.py)."""
        super().__init__(num_experts, fused=fused)
        self.host = host
        self.fp8 = fp8
        self.codec = FP8_ROWS if fp8 else None
        """The rail exchange's rows as FP8 (parallel.dispatch_fp8); the node exchange's stay in their dtype."""
        self.chunks = chunks
        """The tokens' chunks run as a pipeline (parallel.dispatch_chunks: chunk_pipeline.py)."""
        self.nodes, self.ranks_per_node = group_size(rail_group), group_size(node_group)
        size = self.nodes * self.ranks_per_node
        if num_experts % size:
            raise ValueError(f"{num_experts} experts cannot be split over {size} expert-parallel ranks")
        self.rail_group, self.node_group = rail_group, node_group
        self.rank = rank
        self.node, self.local_rank = divmod(rank, self.ranks_per_node)
        self.num_local_experts = num_experts // size
        self.first_local_expert = rank * self.num_local_experts
        self.experts_per_node = self.num_local_experts * self.ranks_per_node
        self.bytes_across_nodes = 0
        """Row bytes this rank sent to other nodes in dispatch (combine returns as many): bench/dispatch.py."""

    def exchange(self, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        k = topk_idx.shape[1]
        parts = list(zip(*(t.tensor_split(self.chunks) for t in (x_TL, topk_idx, topk_weight)), strict=True))
        reached = [self._nodes_reached(idx) for _, idx, _ in parts]  # (node of each copy, [N, T_c] hits) each
        # Counts both exchanges of every chunk need, exchanged on the device before the one host read: rows per
        # node, and copies per expert of each node (which the forwarding ranks sum into what they send on).
        copies = torch.stack([expert_load(idx, self.num_experts).reshape(self.nodes, -1) for _, idx, _ in parts])
        rail_send = torch.stack([hits.sum(1) for _, hits in reached])  # [C, N]
        rail = all_to_all_counts(torch.cat([rail_send.unsqueeze(2), copies], 2).transpose(0, 1).reshape(
            self.nodes, -1), self.rail_group).reshape(self.nodes, self.chunks, -1).transpose(0, 1)
        forward_CGE = rail[:, :, 1:].sum(1).reshape(self.chunks, self.ranks_per_node, self.num_local_experts)
        receive_CGE = all_to_all_counts(forward_CGE.transpose(0, 1).reshape(self.ranks_per_node, -1),
                                        self.node_group)
        receive_CGE = receive_CGE.reshape(self.ranks_per_node, self.chunks, -1).transpose(0, 1)
        splits = self.host.node_split_sizes(rail_send, rail[:, :, 0], forward_CGE.sum(2), receive_CGE.sum(2),
                                  [idx.shape[0] for _, idx, _ in parts], k, self.num_experts, self.rank)
        row = row_bytes(x_TL.shape[1], x_TL.element_size(), self.fp8)
        self.bytes_across_nodes += sum(sum(rail_out) - rail_out[self.node] for (rail_out, _), _ in splits) * row
        self.rows_received += sum(sum(node_in) for _, (_, node_in) in splits)
        outputs: list[torch.Tensor | None] = [None] * self.chunks
        run_interleaved(self._chunk(c, *part, *reached[c], receive_CGE[c], *splits[c], experts, outputs)
                        for c, part in enumerate(parts))
        return torch.cat(outputs)

    def _nodes_reached(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] the node of each copy, [N, T] whether token t has an expert on node n)."""
        num_tokens, k = topk_idx.shape
        hits_NT = torch.zeros(self.nodes, num_tokens, dtype=torch.bool, device=topk_idx.device)
        node_of_copy = topk_idx // self.experts_per_node
        hits_NT[node_of_copy.T.reshape(-1), torch.arange(num_tokens, device=topk_idx.device).repeat(k)] = True
        return node_of_copy, hits_NT

    def _chunk(self, c: int, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
               node_of_copy: torch.Tensor, hits_NT: torch.Tensor, receive_GE: torch.Tensor,
               rail_splits: tuple[list[int], list[int]], node_splits: tuple[list[int], list[int]],
               experts: Experts, outputs: list[torch.Tensor | None]):
        """One chunk of tokens through both exchanges to its experts and back (a generator that yields with
        each rail exchange of rows in flight)."""
        num_tokens, k = topk_idx.shape
        sent_rows = sum(rail_splits[0])
        # 1. rail: row (node b, token t) for every hit, node-major; the token's ids local to node b, or -1.
        pair = torch.argsort((~hits_NT).reshape(-1).to(torch.int8), stable=True)[:sent_rows]
        row_node, token_of_row = pair // num_tokens, pair % num_tokens
        on_node = node_of_copy[token_of_row] == row_node.unsqueeze(1)
        ids_on_node = torch.where(on_node, topk_idx[token_of_row] % self.experts_per_node, -1).to(torch.int32)
        rail_receive, rail_send = rail_splits[1], rail_splits[0]
        weights = all_to_all_rows(topk_weight[token_of_row], rail_receive, rail_send, self.rail_group)
        ids = all_to_all_rows(ids_on_node, rail_receive, rail_send, self.rail_group)
        out, flight = start_rows(x_TL[token_of_row], rail_receive, rail_send, self.rail_group, self.codec)
        yield
        # 2. node: one row per copy, sorted by the node's expert (so by rank of the node, then local expert).
        key = torch.where(ids >= 0, ids, self.experts_per_node).reshape(-1)
        copy = torch.argsort(key, stable=True)[:sum(node_splits[0])]
        row_of_copy = copy // k
        # The node's exchanges (NVLink) are waited for at once: this chunk's experts then run while the other
        # chunks' rail exchanges (the NIC) are in flight.
        out, flight = start_rows(finish_rows(out, flight)[row_of_copy], node_splits[1], node_splits[0],
                                 self.node_group)
        regroup = block_regroup(receive_GE, sum(node_splits[1]))
        y = experts(finish_rows(out, flight)[regroup], receive_GE.sum(0))
        del out
        # Back: each copy to its forwarding rank, which adds a token's copies on its node into its row (few:
        # index_add) and returns the partial rows over the rails; the token's rank sums them as flat combine
        # sums a token's copies (a gather and a sum), over the first of its copies on each node.
        out, flight = start_rows(y[inverse_order(regroup)], node_splits[0], node_splits[1], self.node_group)
        del y
        copies = finish_rows(out, flight)
        weighted = copies * weights.reshape(-1)[copy].to(copies.dtype).unsqueeze(1)
        del out, copies
        partial = _SumRows.apply(weighted, row_of_copy, sum(rail_receive))
        del weighted
        out, flight = start_rows(partial, rail_send, rail_receive, self.rail_group)
        del partial
        yield
        returned = finish_rows(out, flight)
        del out
        row_of_pair = torch.where(hits_NT, torch.cumsum(hits_NT.reshape(-1), 0).reshape(hits_NT.shape) - 1, sent_rows)
        row_of_token = row_of_pair.T.gather(1, node_of_copy)
        same_node = node_of_copy.unsqueeze(2) == node_of_copy.unsqueeze(1)  # [T, k, k]
        earlier = torch.ones(k, k, dtype=torch.bool, device=topk_idx.device).tril(-1)
        row_of_token = torch.where((same_node & earlier).any(2), sent_rows, row_of_token)
        padded = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])
        outputs[c] = padded[row_of_token].sum(1)
