"""Tiny models for tests (every component present, seconds on a CPU): configs, a staged schedule, one MLA layer."""

import torch

from moe_pretrain.config import MLAConfig, load_config
from moe_pretrain.model.init import initialize
from moe_pretrain.model.mla import GatedMLA

EVAL_OFF = ("eval.tokens=0", "eval.every=0")
EVAL = ("eval.tokens=400", "eval.holdout=0.05")
"""Held-out validation on: 400 tokens of each dataset's held-out 5%."""
"""configs/smoke.yaml evaluates every 50 steps and at the end; runs that measure something else need not."""

TINY = [
    "model.hidden_size=32", "model.num_layers=6", "model.layer_pattern=KKMKKM",
    "model.dense_intermediate=48", "model.kda.num_heads=2", "model.kda.head_dim=8",
    "model.kda.chunk_size=16", "model.mla.num_heads=2", "model.mla.q_lora_rank=16",
    "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4",
    "model.mla.v_head_dim=8", "model.moe.num_experts=8", "model.moe.top_k=2",
    "model.moe.expert_intermediate=16", "model.moe.latent_size=16", "model.moe.shared_intermediate=16",
    "model.attn_res.block_size=2", "model.vision.patch_size=4", "data.image_size=16",
    "model.vision.encoder.num_layers=1", "model.vision.encoder.hidden_size=16", "model.vision.encoder.num_heads=2",
    "model.vision.encoder.head_dim=8", "model.vision.encoder.intermediate_size=32", "model.vision.encoder.pos_grid=4",
    "data.seq_len=96", "data.batch_size=4", *EVAL_OFF,
]
"""configs/smoke.yaml shrunk further (command-line overrides): d=32, 6 layers KKMKKM, 8 experts top-2, block 2,
a one-block vision tower of width 16 on 4 x 4 patches (images of 16 x 16, 16 x 8, 8 x 16, 8 x 8 pixels: 4, 2, 2
and 1 tokens); no evaluation (tests that evaluate turn it on)."""


def tiny_config(*overrides: str):
    """The TINY model as a config, with more overrides on top."""
    return load_config("configs/smoke.yaml", [*TINY, *overrides])


STAGES = ("stages=[{name: s96, tokens: 1536, seq_len: 96, batch_tokens: 768, lr_peak: 0.003, lr_end: 0.003, "
          "warmup_tokens: 768, decay: constant}, {name: s192, tokens: 1536, seq_len: 192, batch_tokens: 768, "
          "lr_peak: 0.003, lr_end: 0.001}, {name: s384, tokens: 1536, seq_len: 384, batch_tokens: 768, "
          "lr_peak: 0.001, lr_end: 0.0001, decay: linear}]")


MXFP4_TINY = ("model.moe.expert_intermediate=32", "model.moe.latent_size=32", "model.moe.shared_intermediate=32")
"""The tiny model with expert widths in whole MXFP4 groups of 32 (and the shared experts as wide: the release's
config gives both one width)."""


F64 = torch.float64


def make_layer(position="nope"):
    """A small gated MLA layer (3 heads, width 16) in float64, seeded, and its config."""
    torch.manual_seed(0)
    cfg = MLAConfig(num_heads=3, q_lora_rank=12, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
                    v_head_dim=5, position=position)
    return initialize(GatedMLA(16, cfg, init_std=0.3, out_std=0.3).to(F64), seed=0), cfg
