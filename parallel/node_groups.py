"""The two groups the node dispatch (node_dispatch.py) exchanges over: each expert-parallel group cut by node.

Which ranks share a node is the launcher's to say (torchrun starts LOCAL_WORLD_SIZE ranks per node and
numbers a node's ranks consecutively); parallel.ranks_per_node overrides it, so one machine can declare
"nodes" of two processes. An expert-parallel group must hold the same number G of ranks on each node it
spans, consecutive in its own order (megatron-core's expert groups, expert tensor parallel 1, are blocks of
consecutive ranks): then ep rank s is on the group's node s // G as local rank s % G.
"""

import torch.distributed as dist

from moe_pretrain.config import ConfigError


def node_blocks(members: list[int], ranks_per_node: int) -> list[list[int]]:
    """An expert-parallel group's ranks (in ep order) cut into its nodes' blocks, each G long, in order."""
    blocks: list[list[int]] = []
    for rank in members:
        if blocks and blocks[-1][-1] // ranks_per_node == rank // ranks_per_node:
            blocks[-1].append(rank)
        else:
            blocks.append([rank])
    sizes = {len(b) for b in blocks}
    nodes = [b[0] // ranks_per_node for b in blocks]
    if len(sizes) > 1 or len(set(nodes)) != len(nodes):
        raise ConfigError(
            f"parallel.expert_dispatch=node: the expert-parallel group {members} does not hold an equal, "
            f"contiguous block of ranks on each node of parallel.ranks_per_node={ranks_per_node} ranks "
            f"(blocks {[len(b) for b in blocks]}); use parallel.expert_dispatch=flat or another layout")
    return blocks


def check_node_hosts(hosts: list[str], ranks_per_node: int) -> None:
    """hosts: every rank's host name, in rank order. The ranks numbered onto one node must run on one host:
    a launcher that numbers them otherwise, or a wrong parallel.ranks_per_node, would send the node exchange
    (meant for NVLink) over the NIC and several rail rows through one NIC. The run would be slow, not wrong,
    so it is refused at start. Declared nodes that share a host (tests' nodes of 2 processes) pass."""
    for first in range(0, len(hosts), ranks_per_node):
        block = hosts[first:first + ranks_per_node]
        if len(set(block)) > 1:
            raise ConfigError(
                f"parallel.expert_dispatch=node: ranks {first}-{first + len(block) - 1} are numbered as one node "
                f"of {ranks_per_node} (parallel.ranks_per_node, else the launcher's LOCAL_WORLD_SIZE) but run on "
                f"hosts {', '.join(sorted(set(block)))}; set parallel.ranks_per_node to the ranks each node "
                f"starts, or parallel.expert_dispatch=flat")


def expert_node_groups(ep_groups: list[list[int]] | list[tuple[int, ...]], ranks_per_node: int, rank: int
                       ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(rail, node) groups of `rank` from every expert-parallel group of the job (global ranks, ep order),
    created alike on every rank (group creation is collective). rail: one rank per node of its ep group, the
    same local index on each, in node order; node: the ep group's ranks on this rank's node, in ep order."""
    rails, nodes = [], []
    for members in map(list, ep_groups):
        blocks = node_blocks(members, ranks_per_node)
        nodes.extend(blocks)
        rails.extend([block[i] for block in blocks] for i in range(len(blocks[0])))
    rail_group = _subgroups(rails)
    node_group = _subgroups(nodes)
    mine = next(list(m) for m in ep_groups if rank in m)
    blocks = node_blocks(mine, ranks_per_node)
    node, local = divmod(mine.index(rank), len(blocks[0]))
    for group, expected, what in ((rail_group, node, "rail"), (node_group, local, "node")):
        if group is not None and dist.get_rank(group) != expected:
            raise RuntimeError(f"rank {rank}: the {what} group numbers it {dist.get_rank(group)}, not {expected}")
    return rail_group, node_group


def _subgroups(groups: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's group among `groups` (None where every group is a single rank: nothing to exchange)."""
    if max(len(g) for g in groups) == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group
