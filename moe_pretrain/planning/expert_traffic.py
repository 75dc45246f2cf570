"""What one GPU sends in the expert-parallel all-to-alls of one MoE layer and micro-batch, per group: flat
(parallel/all_to_all_dispatch.py) or by node (parallel/node_dispatch.py), counted as the dry run counts them
(planning/collective_traffic.py: a payload's (n - 1) / n)."""

import math

from moe_pretrain.config import Config
from moe_pretrain.planning.tensor_parallel_traffic import ring_share
from parallel.fp8_dispatch import row_bytes
from parallel.node_groups import node_blocks

ID_BYTES = 4
"""The node dispatch's expert ids travel as int32."""


def distinct_nodes(experts: int, k: int, nodes: int) -> float:
    """Nodes a token reaches when its k distinct experts are drawn uniformly from `experts` spread evenly over
    `nodes`: each node is missed with probability C(E - E/N, k) / C(E, k) (16 x (1 - (15/16)^16) ~ 10.3 for top-16
    of 896 over 16 nodes, as sampling with replacement puts it; 10.35 without)."""
    missed = math.comb(experts - experts // nodes, k) / math.comb(experts, k)
    return nodes * (1 - missed)


def plan_ranks_per_node(cfg: Config) -> int:
    """Ranks sharing a node as a job of cfg on its cluster sees them (parallel.ranks_per_node, else the
    launcher's: cluster.gpus_per_node)."""
    return cfg.parallel.ranks_per_node or cfg.cluster.gpus_per_node


def node_shape(cfg: Config, ep: int) -> tuple[int, int]:
    """(nodes, ranks per node) of an expert-parallel group of `ep` consecutive ranks on cfg's cluster."""
    blocks = node_blocks(list(range(ep)), plan_ranks_per_node(cfg))
    return len(blocks), len(blocks[0])


def exchange_buffer_rows(cfg: Config, ep: int, tokens: float) -> float:
    """Latent rows a MoE layer's dispatch holds at once for `tokens` tokens of its own: the routed copies sent
    and received (flat), and by node also the rows out and in over the rails (one per node a token reaches)."""
    m = cfg.model.moe
    copies = 2 * m.top_k * tokens
    if cfg.parallel.expert_dispatch == "flat":
        return copies
    return copies + 2 * tokens * distinct_nodes(m.num_experts, m.top_k, node_shape(cfg, ep)[0])


def expert_exchange_bytes(cfg: Config, ep: int, tokens: float, passes: int, act_bytes: int) -> dict[str, float]:
    """Bytes one GPU of an expert-parallel group of `ep` consecutive ranks sends for `tokens` tokens of its own
    in one MoE layer: `passes` passes (forward, backward, a re-forward), each moving rows out (dispatch) and
    back (combine). Flat: one latent row per routed copy, group "ep". By node: "ep rail" carries one row per
    node a token reaches, with its k expert ids and routing weights (the ids forward, the weights forward and
    their gradients back), and "ep node" one row per copy inside the node. parallel.dispatch_fp8: the forward
    passes' dispatch rows (flat's, or the rail's) in FP8 (parallel/fp8_dispatch.py)."""
    m = cfg.model.moe
    row = m.latent_size * act_bytes
    forward_passes = passes - 1
    dispatched = row_bytes(m.latent_size, act_bytes, cfg.parallel.dispatch_fp8)
    per_row = forward_passes * (dispatched + row) + 2 * row  # out and back in each pass, the backward's in bf16
    if cfg.parallel.expert_dispatch == "flat":
        return {"ep": ring_share(ep, m.top_k * tokens * per_row)}
    nodes, per_node = node_shape(cfg, ep)
    rows = tokens * distinct_nodes(m.num_experts, m.top_k, nodes)
    weight = max(4, act_bytes)  # the router's dtype: float32, or the run's float64
    metadata = rows * m.top_k * (forward_passes * (ID_BYTES + weight) + weight)
    return {"ep rail": ring_share(nodes, rows * per_row + metadata),
            "ep node": passes * 2 * ring_share(per_node, m.top_k * tokens * row)}
