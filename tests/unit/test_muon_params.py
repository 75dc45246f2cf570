"""Per-Head Muon's parameter rules at full size (meta tensors): which parameters Muon takes, and the head blocks of
Q / K / V (also on a tensor-parallel shard)."""

import re

import torch

from moe_pretrain.config import load_config
from moe_pretrain.model.meta import meta_model
from moe_pretrain.ops.newton_schulz import muon_update
from moe_pretrain.training.muon_params import MuonRule, as_matrices, muon_rule


def test_full_size_rules():
    cfg = load_config("configs/full.yaml")
    model = meta_model(cfg.model)
    rules = {re.sub(r"\.\d+\.", ".N.", name): muon_rule(name, p, cfg.model) for name, p in model.named_parameters()}
    adamw = sorted(name for name, rule in rules.items() if rule is None and not name.startswith("mtp."))
    per_head = {name: rule.head_rows for name, rule in rules.items() if rule and rule.head_rows}
    assert per_head == {"layers.N.mixer.q_proj.weight": 128, "layers.N.mixer.k_proj.weight": 128,
                        "layers.N.mixer.v_proj.weight": 128, "layers.N.mixer.q_up.weight": 192,
                        "layers.N.mixer.kv_up.weight": 256,  # and the multi-token-prediction block's MLA layer:
                        "mtp.N.layer.mixer.q_up.weight": 192, "mtp.N.layer.mixer.kv_up.weight": 256}
    assert adamw == sorted([
        "embedding.weight", "head.weight", "final_mix.norm_weight", "final_mix.pseudo_query.weight",
        "final_norm.weight", "layers.N.attn_mix.norm_weight", "layers.N.attn_mix.pseudo_query.weight",
        "layers.N.attn_norm.weight", "layers.N.mlp_mix.norm_weight", "layers.N.mlp_mix.pseudo_query.weight",
        "layers.N.mlp_norm.weight", "layers.N.mixer.A_log", "layers.N.mixer.dt_bias", "layers.N.mixer.o_norm_weight",
        "layers.N.mixer.q_conv.weight", "layers.N.mixer.k_conv.weight", "layers.N.mixer.v_conv.weight",
        "layers.N.mixer.q_norm.weight", "layers.N.mixer.kv_norm.weight", "layers.N.mlp.latent_norm.weight",
        "mm_projector.post_norm.weight", "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.N.norm0.weight", "vision_tower.encoder.blocks.N.norm1.weight",
        "vision_tower.encoder.final_layernorm.weight"])
    # The multi-token-prediction block's vectors and its layer's, as the backbone's (its projection is a matrix).
    assert sorted(name for name, rule in rules.items() if rule is None and name.startswith("mtp.")) == sorted([
        "mtp.N.hidden_norm.weight", "mtp.N.embedding_norm.weight", "mtp.N.norm.weight",
        *(f"mtp.N.layer.{name}" for name in (
            "attn_mix.norm_weight", "attn_mix.pseudo_query.weight", "attn_norm.weight", "mlp_mix.norm_weight",
            "mlp_mix.pseudo_query.weight", "mlp_norm.weight", "mixer.q_norm.weight", "mixer.kv_norm.weight",
            "mlp.latent_norm.weight"))])
    muon = sum(p.numel() for name, p in model.named_parameters() if muon_rule(name, p, cfg.model))
    total = sum(p.numel() for p in model.parameters())
    assert 0.99 < muon / total < 1.0  # all but the embeddings, head and vectors
    params = dict(model.named_parameters())
    assert as_matrices(params["vision_tower.patch_embed.proj.weight"]).shape == (1024, 588)
    assert as_matrices(params["layers.1.mlp.experts.w_gate"]).shape == (896, 3072, 3584)


def test_a_tensor_parallel_shard_keeps_its_heads_blocks():
    """q_proj of 8 heads of 16 rows, split over 2 tensor-parallel ranks: each shard's per-head update is the
    whole matrix's for those heads."""
    cfg = load_config("configs/full.yaml", ["model.kda.head_dim=16"])
    rule = muon_rule("layers.0.mixer.q_proj.weight", torch.empty(128, 64), cfg.model)
    assert rule == MuonRule(16)
    whole = torch.randn(128, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    update = muon_update(whole, heads=128 // rule.head_rows)
    for shard in (slice(0, 64), slice(64, 128)):
        assert torch.allclose(muon_update(whole[shard], heads=64 // rule.head_rows), update[shard], atol=1e-12)
