"""The parameter / FLOP counter: exact against instantiated models, and the full-size figures."""

import itertools
import json
import subprocess
import sys

import pytest
import torch

from moe_pretrain.config import EX_CONFIG, load_config
from moe_pretrain.model import MoETransformer
from moe_pretrain.model.counts import count, total_parts
from moe_pretrain.planning.expert_traffic import distinct_nodes, expert_exchange_bytes
from tests.models import tiny_config


@pytest.mark.parametrize("overrides", [
    (),
    ("model.mla.position=rope", "model.kda.gate=softplus"),
    ("model.dense_layers=0", "model.moe.num_shared_experts=0"),
    ("model.dense_layers=6", "model.layer_pattern=MMMMMM"),
    ("model.moe.num_experts=5", "model.moe.top_k=4", "model.kda.conv_size=2", "model.vocab_size=300"),
])
def test_counted_total_equals_numel(overrides):
    cfg = tiny_config(*overrides)
    model = MoETransformer(cfg.model)
    numel = sum(p.numel() for p in model.parameters())
    assert count(cfg.model, cfg.data.seq_len)["total_params"] == numel


def test_smoke_config_count_equals_numel():
    cfg = load_config("configs/smoke.yaml")
    assert count(cfg.model, 256)["total_params"] == sum(p.numel() for p in MoETransformer(cfg.model).parameters())


def test_active_params_count_only_visited_experts():
    cfg = tiny_config()
    result = count(cfg.model, 64)
    moe = cfg.model.moe
    per_expert = 3 * moe.latent_size * moe.expert_intermediate
    idle = result["moe_layers"] * (moe.num_experts - moe.top_k) * per_expert
    assert result["active_params"] == result["total_params"] - idle


def test_full_size_figures():
    cfg = load_config("configs/full.yaml")
    result = count(cfg.model, cfg.data.seq_len)
    assert result["total_params"] == pytest.approx(2.8e12, rel=0.02)
    assert result["active_params"] == pytest.approx(1.04e11, rel=0.03)
    # 6 x active is the bulk of the training FLOPs; attention adds a few percent at 8K.
    assert 6 * result["active_params"] < result["flops_per_token"] < 7 * result["active_params"]


def test_the_total_says_what_it_counts():
    """launch.plan printed 2.81e12 beside docs/usage.md's 2.7795e12 without saying it counts the MTP block and the
    tower."""
    cfg = load_config("configs/full.yaml")
    parts = total_parts(cfg.model, cfg.data.seq_len)
    assert parts == ("2.7795e+12 in the 93-layer backbone with embedding and head, 3.0120e+10 in 1 "
                     "multi-token-prediction block(s), 4.4736e+08 in the vision tower and projector")
    figures = [float(word) for word in parts.replace(",", " ").split() if "e+" in word]
    assert sum(figures) == pytest.approx(count(cfg.model, cfg.data.seq_len)["total_params"], rel=1e-4)


def test_flops_grow_with_sequence_length():
    cfg = load_config("configs/full.yaml")
    short, long = count(cfg.model, 8192), count(cfg.model, 1 << 20)
    assert long["flops_breakdown"]["mla_mixing"] == pytest.approx(128 * short["flops_breakdown"]["mla_mixing"])
    assert long["flops_breakdown"]["kda_mixing"] == short["flops_breakdown"]["kda_mixing"]  # linear attention


@pytest.mark.timeout(60)
def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "moe_pretrain.planning.sizing", "configs/full.yaml", "--json"],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert {"total_params", "active_params", "flops_per_token", "breakdown"} <= result.keys()
    bad = subprocess.run([sys.executable, "-m", "moe_pretrain.planning.sizing", "configs/full.yaml",
                          "model.moe.top_k=0"], capture_output=True, text=True)
    assert bad.returncode == EX_CONFIG and "model.moe.top_k=0 must be > 0" in bad.stderr


def test_numel_counts_stacked_experts():
    cfg = tiny_config()
    model = MoETransformer(cfg.model)
    router = model.routers()[1]
    assert router.expert_bias.requires_grad is False
    experts = model.layers["1"].mlp.experts
    assert experts.w_gate.shape == (8, 16, 16) and isinstance(experts.w_gate, torch.nn.Parameter)


def test_the_node_dispatch_is_priced_by_the_nodes_a_token_reaches():
    """distinct_nodes against every routing of 3 of 8 experts over 2 and 4 nodes; at full size the rail
    exchange's NIC bytes against flat dispatch's (its copies for other nodes)."""
    for nodes in (2, 4):
        visits = [len({e // (8 // nodes) for e in chosen}) for chosen in itertools.combinations(range(8), 3)]
        assert distinct_nodes(8, 3, nodes) == pytest.approx(sum(visits) / len(visits), rel=1e-12)
    assert distinct_nodes(896, 16, 16) == pytest.approx(10.35, abs=0.01)
    cfg = load_config("configs/full.yaml")
    flat = expert_exchange_bytes(cfg, 128, 2048, 3, 2)["ep"] * (1 - 7 / 127)  # 7 of the other 127 share its node
    node_cfg = load_config("configs/full.yaml", ["parallel.expert_dispatch=node"])
    by_node = expert_exchange_bytes(node_cfg, 128, 2048, 3, 2)
    assert by_node["ep rail"] / flat == pytest.approx(10.35 * 15 / 16 / (16 * 120 / 127), rel=0.02)  # 0.64
