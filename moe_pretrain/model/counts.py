"""The model's parameter and FLOP counts from its config alone, by the model's own formulas.

Counts mirror the modules in moe_pretrain/model one for one (tests check total == sum(p.numel()) on
instantiated models), so the full-size figures (docs/model.md: ~2.8T total, ~104B active) come from the
same definitions the code trains. `python -m moe_pretrain.planning.sizing CONFIG` prints them.

active_params: parameters touched per token = total minus the routed experts a token does not visit
(num_experts - top_k per MoE layer); embedding and head are counted, as in published MoE figures.
flops_per_token (training, forward + backward = 3 x forward): 6 per active parameter that multiplies
activations (all but the input embedding lookup and the vision tower and projector, which act on image
patches, not on text tokens; norm and bias vectors are counted too, which is < 0.01%), plus sequence mixing
at the configured sequence length, by each mixer's spec (model/kda_spec.py, model/mla_spec.py).
"""

import dataclasses

import numpy as np
import torch

from moe_pretrain.config import ModelConfig, MoEConfig, VisionEncoderConfig
from moe_pretrain.model.mixers import MIXERS, mixer_spec


def vision_tower_params(c: VisionEncoderConfig, patch_size: int, channels: int) -> int:
    """The vision tower (model/vision_tower.py): patch embedding, position table, blocks, final norm."""
    width = c.num_heads * c.head_dim
    block = 2 * c.hidden_size + 4 * c.hidden_size * width + 2 * c.hidden_size * c.intermediate_size
    return (channels * patch_size * patch_size * c.hidden_size + c.pos_grid * c.pos_grid * c.hidden_size
            + c.num_layers * block + c.hidden_size)


def vision_projector_params(c: VisionEncoderConfig, d: int) -> int:
    """The projector from merged vision tokens to the language model's width (Linear, Linear, RMSNorm)."""
    return c.merged_size * c.merged_size + c.merged_size * d + d


def situ_glu_params(d: int, intermediate: int) -> int:
    return 3 * d * intermediate


def routed_expert_params(c: MoEConfig) -> int:
    """One routed expert: SiTU-GLU in the latent dim."""
    return situ_glu_params(c.latent_size, c.expert_intermediate)


def moe_params(d: int, c: MoEConfig) -> dict[str, int]:
    return {
        "router": d * c.num_experts,
        "latent_projections": d * c.latent_size + c.latent_size + c.latent_size * d,
        "routed_experts": c.num_experts * routed_expert_params(c),
        "shared_experts": situ_glu_params(d, c.num_shared_experts * c.shared_intermediate),
    }


def mixing_flops_per_token(cfg: ModelConfig, index: int, seq_len: int, keys: float | None = None) -> float:
    """Training FLOPs per token of layer `index`'s sequence mixing beyond its projections (module docstring).
    keys: the keys a query attends to on average (attention stays inside a document: planning/documents.py
    measures it from the data); None: seq_len / 2, one document per row (the bound)."""
    return mixer_spec(cfg, index).mixing_flops(cfg, seq_len, keys)


def layer_flops_per_token(cfg: ModelConfig, index: int, seq_len: int, keys: float | None = None) -> float:
    """Training FLOPs per token of decoder layer `index` (a multi-token-prediction block's from num_layers on):
    6 per parameter a token multiplies (of the routed experts, its top_k), its norms and AttnRes mixes
    included, plus its sequence mixing."""
    d = cfg.hidden_size
    params = 3 * 2 * d + mixer_spec(cfg, index).params(cfg)
    if cfg.is_moe_layer(index):
        moe = moe_params(d, cfg.moe)
        params += moe["router"] + moe["latent_projections"] + moe["shared_experts"]
        params += cfg.moe.top_k * routed_expert_params(cfg.moe)
    else:
        params += situ_glu_params(d, cfg.dense_intermediate)
    return 6 * params + mixing_flops_per_token(cfg, index, seq_len, keys)


def ends_params(cfg: ModelConfig, last: bool) -> int:
    """Parameters multiplying activations outside the decoder layers, per token, on the first pipeline stage
    (none: the embedding is a lookup, the vision tower acts on patches) or the last: the final mix and norm,
    the head once per head call (the backbone's and each multi-token-prediction block's) and the blocks'
    own projections and norms."""
    if not last:
        return 0
    d = cfg.hidden_size
    return 3 * d + (1 + cfg.mtp.layers) * d * cfg.vocab_size + cfg.mtp.layers * (2 * d * d + 3 * d)


def attended_keys(doc_ids: torch.Tensor) -> float:
    """Mean keys an attention query sees over rows doc_ids [B, T] (each row's document numbers, non-decreasing):
    attention stays inside a document, so a row packed with documents of lengths L_1 .. L_n gives its queries
    sum L (L + 1) / 2 keys in all (causal), (T + 1) / 2 a query where one document fills the row. Counted on
    the host (numpy), so it launches nothing and reads no device."""
    ids = doc_ids.cpu().numpy()
    starts = np.ones(ids.shape, dtype=bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = np.flatnonzero(starts.reshape(-1))
    lengths = np.diff(np.append(first, ids.size)).astype(np.float64)
    return float((lengths * (lengths + 1) / 2).sum() / ids.size)


def count(cfg: ModelConfig, seq_len: int, keys: float | None = None) -> dict:
    """The model's parameters and its training FLOPs per token at seq_len; keys: the keys a query of MLA's
    attention sees (attended_keys over the step's documents), None: one document per row (the bound)."""
    d = cfg.hidden_size
    per_layer_vectors = 3 * 2 * d  # two AttnRes mixes (query + norm weight) and two pre-norms
    breakdown = {
        "embedding": cfg.vocab_size * d,
        "vision_tower": vision_tower_params(cfg.vision.encoder, cfg.vision.patch_size, cfg.vision.channels),
        "mm_projector": vision_projector_params(cfg.vision.encoder, d),
        "head": d * cfg.vocab_size,
        "final_mix_and_norm": 3 * d,
        "layer_norms_and_mixes": (cfg.num_layers + cfg.mtp.layers) * per_layer_vectors,
        **dict.fromkeys(MIXERS, 0), "dense_mlp": 0,
        "router": 0, "latent_projections": 0, "routed_experts": 0, "shared_experts": 0,
        # Each multi-token-prediction block: two input norms, the projection, the norm before the shared head;
        # its decoder layer is counted with the backbone's (indices num_layers on).
        "mtp_blocks": cfg.mtp.layers * (2 * d * d + 3 * d),
    }
    moe_layers = 0
    layers = range(cfg.num_layers + cfg.mtp.layers)
    for i in layers:
        breakdown[cfg.layer_kind(i)] += mixer_spec(cfg, i).params(cfg)
        if cfg.is_moe_layer(i):
            moe_layers += 1
            for key, value in moe_params(d, cfg.moe).items():
                breakdown[key] += value
        else:
            breakdown["dense_mlp"] += situ_glu_params(d, cfg.dense_intermediate)
    total = sum(breakdown.values())
    idle_experts = moe_layers * (cfg.moe.num_experts - cfg.moe.top_k) * routed_expert_params(cfg.moe)
    active = total - idle_experts

    layer_flops = [layer_flops_per_token(cfg, i, seq_len, keys) for i in layers]
    mixing = [mixing_flops_per_token(cfg, i, seq_len, keys) for i in layers]
    flops = sum(layer_flops) + 6 * ends_params(cfg, last=True)
    by_mixer = dict.fromkeys(MIXERS, 0.0)
    for i, f in zip(layers, mixing):
        by_mixer[cfg.layer_kind(i)] += f
    return {
        "total_params": total,
        "active_params": active,
        "flops_per_token": flops,
        "seq_len": seq_len,
        "moe_layers": moe_layers,
        "breakdown": breakdown,
        "flops_breakdown": {
            "dense_matmuls": flops - sum(mixing),
            **{f"{kind}_mixing": f for kind, f in by_mixer.items()},
        },
    }


def total_parts(cfg: ModelConfig, seq_len: int) -> str:
    """What the total counts, in words: the backbone (its layers, embedding and head), the multi-token-prediction
    blocks (each a decoder layer and its projections) and the vision tower with its projector."""
    result = count(cfg, seq_len)
    vision = result["breakdown"]["vision_tower"] + result["breakdown"]["mm_projector"]
    backbone = count(dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, layers=0)), seq_len)["total_params"]
    backbone -= vision
    text = f"{backbone:.4e} in the {cfg.num_layers}-layer backbone with embedding and head"
    if cfg.mtp.layers:
        mtp = result["total_params"] - backbone - vision
        text += f", {mtp:.4e} in {cfg.mtp.layers} multi-token-prediction block(s)"
    return text + f", {vision:.4e} in the vision tower and projector"
