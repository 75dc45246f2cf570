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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_pretrain.ops.host_values import node_split_sizes
from moe_pretrain.ops.routing import expert_load
from parallel.all_to_all_dispatch import block_regroup, inverse_order
from parallel.collectives import all_to_all_counts, all_to_all_rows, group_size
from parallel.dispatch import LocalTokenDispatcher
from parallel.fp8_dispatch import all_to_all_rows_fp8, row_bytes


@dataclass(frozen=True)
class NodeDispatchMetadata:
    row_of_token: torch.Tensor
    """[T, k] the rail row that carries copy j of token t to its node, for the first of a token's copies on
    each node; U (one past the rows) for the others, whose node's partial is counted once."""
    rail_splits: tuple[list[int], list[int]]
    """(rows sent to each node, rows received from each node) in the rail exchange."""
    node_splits: tuple[list[int], list[int]]
    """(copies sent to each rank of the node, copies received from each) in the node exchange."""
    row_of_copy: torch.Tensor
    """[V] the rail-received row each copy this rank forwarded belongs to."""
    weight_of_copy: torch.Tensor
    """[V] that copy's routing weight."""
    regroup: torch.Tensor
    """[R] node-received row index of each row in local-expert order."""


class NodeTokenDispatcher(LocalTokenDispatcher):
    """ep ranks as N nodes of G (rail_group: this rank's peers of the same local index, one per node, in node
    order; node_group: the G ranks of this node, in local order)."""

    def __init__(self, num_experts: int, rank: int, rail_group: dist.ProcessGroup | None,
                 node_group: dist.ProcessGroup | None, *, fused: bool = False, fp8: bool = False):
        super().__init__(num_experts, fused=fused)
        self.fp8 = fp8
        self.send_rows = all_to_all_rows_fp8 if fp8 else all_to_all_rows
        """The rail exchange of rows (parallel.dispatch_fp8: as FP8; the node exchange stays in their dtype)."""
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

    def dispatch(self, x_TL, topk_idx, topk_weight):
        num_tokens, k = topk_idx.shape
        node_of_copy = topk_idx // self.experts_per_node
        hits_NT = torch.zeros(self.nodes, num_tokens, dtype=torch.bool, device=topk_idx.device)
        hits_NT[node_of_copy.T.reshape(-1), torch.arange(num_tokens, device=topk_idx.device).repeat(k)] = True
        # Counts both exchanges need, exchanged on the device before the one host read: rows per node, and
        # copies per expert of each node (which the forwarding ranks sum into what they send on).
        copies_NE = expert_load(topk_idx, self.num_experts).reshape(self.nodes, -1)
        rail_counts = all_to_all_counts(torch.cat([hits_NT.sum(1, keepdim=True), copies_NE], 1), self.rail_group)
        forward_GE = rail_counts[:, 1:].sum(0).reshape(self.ranks_per_node, self.num_local_experts)
        receive_GE = all_to_all_counts(forward_GE, self.node_group)  # [source rank of the node, local expert]
        rail_splits, node_splits = node_split_sizes(hits_NT.sum(1), rail_counts[:, 0], forward_GE.sum(1),
                                                    receive_GE.sum(1), num_tokens, k, self.num_experts,
                                                    self.rank)
        sent_rows = sum(rail_splits[0])
        self.bytes_across_nodes += (sent_rows - rail_splits[0][self.node]) * row_bytes(x_TL, self.fp8)
        # 1. rail: row (node b, token t) for every hit, node-major; the token's ids local to node b, or -1.
        pair = torch.argsort((~hits_NT).reshape(-1).to(torch.int8), stable=True)[:sent_rows]
        row_node, token_of_row = pair // num_tokens, pair % num_tokens
        row_of_pair = torch.where(hits_NT, torch.cumsum(hits_NT.reshape(-1), 0).reshape(hits_NT.shape) - 1, sent_rows)
        row_of_token = row_of_pair.T.gather(1, node_of_copy)
        same_node = node_of_copy.unsqueeze(2) == node_of_copy.unsqueeze(1)  # [T, k, k]
        earlier = torch.ones(k, k, dtype=torch.bool, device=topk_idx.device).tril(-1)
        row_of_token = torch.where((same_node & earlier).any(2), sent_rows, row_of_token)
        ids = topk_idx[token_of_row]
        on_node = ids // self.experts_per_node == row_node.unsqueeze(1)
        ids_on_node = torch.where(on_node, ids % self.experts_per_node, -1).to(torch.int32)
        rail_out, rail_in = rail_splits[1], rail_splits[0]
        rows = self.send_rows(x_TL[token_of_row], rail_out, rail_in, self.rail_group)
        weights = all_to_all_rows(topk_weight[token_of_row], rail_out, rail_in, self.rail_group)
        ids = all_to_all_rows(ids_on_node, rail_out, rail_in, self.rail_group)
        # 2. node: one row per copy, sorted by the node's expert (so by rank of the node, then local expert).
        forwarded = sum(node_splits[0])
        key = torch.where(ids >= 0, ids, self.experts_per_node).reshape(-1)
        copy = torch.argsort(key, stable=True)[:forwarded]
        row_of_copy = copy // k
        received = all_to_all_rows(rows[row_of_copy], node_splits[1], node_splits[0], self.node_group)
        regroup = block_regroup(receive_GE, sum(node_splits[1]))
        meta = NodeDispatchMetadata(row_of_token, rail_splits, node_splits, row_of_copy,
                                    weights.reshape(-1)[copy], regroup)
        return received[regroup], receive_GE.sum(0), meta

    def combine(self, y_grouped, meta: NodeDispatchMetadata):
        """Each copy's output back to its forwarding rank, weighted and added into its row there (index_add: a
        row's copies on one node are few), the partial rows back over the rails and summed per token as the
        local dispatcher sums a token's copies (a gather and a sum, in y's dtype)."""
        copies = all_to_all_rows(y_grouped[inverse_order(meta.regroup)], meta.node_splits[0], meta.node_splits[1],
                                 self.node_group)
        weighted = copies * meta.weight_of_copy.to(copies.dtype).unsqueeze(1)
        partial = weighted.new_zeros(sum(meta.rail_splits[1]), copies.shape[1]).index_add(0, meta.row_of_copy,
                                                                                           weighted)
        returned = all_to_all_rows(partial, meta.rail_splits[0], meta.rail_splits[1], self.rail_group)
        padded = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])
        return padded[meta.row_of_token].sum(1)
