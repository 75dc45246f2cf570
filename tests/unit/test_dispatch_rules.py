"""The expert dispatch's rules that need no process: an FP8 row's bytes, the node blocks an expert group is cut into
(or why not), and ranks numbered onto one node sharing a host."""

import pytest

from moe_pretrain.config import ConfigError
from parallel.fp8_dispatch import row_bytes
from parallel.node_groups import check_node_hosts, node_blocks


def test_an_fp8_row_takes_a_byte_a_value_and_a_scale_a_block():
    assert row_bytes(3584, 2, fp8=False) == 7168  # a bf16 latent row
    assert row_bytes(3584, 2, fp8=True) == 3584 + 28 * 4  # 0.516 of bf16's


def test_node_blocks_cut_an_expert_group_by_node_or_name_why_not():
    assert node_blocks([8, 9, 10, 11, 12, 13, 14, 15], 4) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert node_blocks([0, 4, 8, 12], 4) == [[0], [4], [8], [12]]  # one rank per node: rails only
    for members in ([0, 1, 2], [0, 2, 1, 3]):  # unequal blocks; a node met twice
        with pytest.raises(ConfigError, match=r"parallel\.ranks_per_node=2"):
            node_blocks(members, 2)


def test_ranks_numbered_onto_one_node_must_share_a_host():
    check_node_hosts(["a", "a", "b", "b"], 2)
    check_node_hosts(["a"] * 4, 2)  # one machine declaring nodes of 2 processes
    with pytest.raises(ConfigError, match=r"ranks 0-1 are numbered as one node of 2 .* hosts a, b"):
        check_node_hosts(["a", "b", "a", "b"], 2)  # a launcher that deals ranks round-robin over the nodes
