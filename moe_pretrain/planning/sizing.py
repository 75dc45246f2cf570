"""Parameter and FLOP counter from the model's own formulas: `python -m moe_pretrain.planning.sizing CONFIG --json`;
with `--layout tp=8,pp=16,ep=128,dp=32`, also each pipeline stage's per-rank state bytes (rank_state.py).

Counts mirror the modules in moe_pretrain/model one for one (tests check total == sum(p.numel()) on
instantiated models), so the full-size figures (docs/model.md: ~2.8T total, ~104B active) come from the
same definitions the code trains.

active_params: parameters touched per token = total minus the routed experts a token does not visit
(num_experts - top_k per MoE layer); embedding and head are counted, as in published MoE figures.
flops_per_token (training, forward + backward = 3 x forward): 6 per active parameter that multiplies
activations (all but the input embedding lookup and the vision tower and projector, which act on image
patches, not on text tokens; norm and bias vectors are counted too, which is < 0.01%), plus sequence mixing
at the configured sequence length:
gated MLA, causal attention over T/2 keys on average, 3 * 2 * H * (d_qk + d_v) * T/2;
KDA, the chunked algorithm per head, 3 * (2 C K + C (K + V) + C V + 6 K V) for chunk C.
"""

import argparse
import dataclasses
import json
import sys

from moe_pretrain.config import (
    EX_CONFIG,
    ConfigError,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    VisionEncoderConfig,
    add_config_arguments,
    load_config_or_exit,
)


def kda_params(d: int, c: KDAConfig) -> int:
    H, K = c.num_heads, c.head_dim
    inner = H * K
    return (
        3 * d * inner            # q, k, v projections
        + 3 * inner * c.conv_size  # short convolutions
        + d * K + K * inner      # low-rank decay logits W_fa, W_fb
        + H + inner              # A_log, dt_bias
        + d * H                  # beta
        + d * inner              # output gate
        + K                      # per-head output RMSNorm weight (shared by heads)
        + inner * d              # output projection
    )


def mla_params(d: int, c: MLAConfig) -> int:
    H = c.num_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    return (
        d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * qk
        + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
        + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
        + d * H * c.v_head_dim   # output gate
        + H * c.v_head_dim * d   # output projection
    )


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
    if cfg.layer_kind(index) == "mla":
        m = cfg.mla
        keys = seq_len / 2 if keys is None else keys
        return 3 * 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * keys
    k = cfg.kda
    C, K, V = k.chunk_size, k.head_dim, k.head_dim
    return 3 * k.num_heads * (2 * C * K + C * (K + V) + C * V + 6 * K * V)


def layer_flops_per_token(cfg: ModelConfig, index: int, seq_len: int, keys: float | None = None) -> float:
    """Training FLOPs per token of decoder layer `index` (a multi-token-prediction block's from num_layers on):
    6 per parameter a token multiplies (of the routed experts, its top_k), its norms and AttnRes mixes
    included, plus its sequence mixing."""
    d = cfg.hidden_size
    params = 3 * 2 * d + (kda_params(d, cfg.kda) if cfg.layer_kind(index) == "kda" else mla_params(d, cfg.mla))
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


def final_projection_params(cfg: ModelConfig, index: int) -> int:
    """The weights of layer `index`'s last matmul: the dense MLP's or the shared experts' down projection, or
    the MoE's latent up projection without shared experts."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(index):
        return cfg.dense_intermediate * d
    if cfg.moe.num_shared_experts:
        return cfg.moe.num_shared_experts * cfg.moe.shared_intermediate * d
    return cfg.moe.latent_size * d


LATENT_KEY_BLOCK = 1024
"""ops.latent_attention's key block (and query tile): a tile meets each key block it may see whole."""


@dataclasses.dataclass(frozen=True)
class ExchangeSpan:
    """What MLA's latent exchange does under a stage's documents (planning/documents.exchange_span), per local
    token of a cp rank: the keys it expands (the key blocks some query tile of its may see), and the keys of
    the blocks its query's tile meets. Without documents (one per row) these are cp and about half the row."""
    expanded_keys: float
    tile_keys: float


@dataclasses.dataclass(frozen=True)
class StageDocuments:
    """What a stage's documents make of MLA's attention (planning/documents.py), for the plan set beside a dry
    run: the keys a query attends to (attention stays inside a document), and under the latent exchange what
    the exchange does (None: no exchange). Without it the plan prices one document per row, the bound."""
    keys: float
    span: ExchangeSpan | None = None


def latent_exchange_flops_per_token(cfg: ModelConfig, seq_len: int, cp: int, recompute: str, rows: int,
                                    documents: StageDocuments | None = None) -> float:
    """What MLA's latent exchange (context parallelism by the latent, ops/latent_attention.py) adds per local
    token over the plain layer: each rank expands the keys and values of the blocks its queries may see (the
    kv up-projection: forward, again in the backward, and its two gradient products; once more for full
    recomputation) instead of its own positions', and its score tiles are whole key blocks, so a query meets
    more keys than the plain layer's attention is priced at. documents with a span: both from the stage's
    documents; otherwise one document per row (all cp x its positions expanded; the causal half plus half a
    block, or every key of the micro-batch's `rows` rows when one block holds them all)."""
    a = cfg.mla
    up = a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    passes = 10 if recompute == "full" else 8
    span = documents.span if documents else None
    expanded = span.expanded_keys if span else cp
    expand = passes * expanded * up - (8 if recompute == "full" else 6) * up
    if span:
        extra = span.tile_keys - documents.keys
    elif rows * seq_len <= LATENT_KEY_BLOCK:
        extra = rows * seq_len - seq_len / 2
    else:
        extra = min(seq_len, (seq_len + LATENT_KEY_BLOCK) / 2) - seq_len / 2
    tiles = 3.5 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * extra
    return expand + tiles * (4.5 / 3.5 if recompute == "full" else 1.0)  # recomputation: a forward more


def stage_flops_per_token(cfg: ModelConfig, layers: list[int], last: bool, seq_len: int, recompute: str,
                          cp: int = 1, mla: str = "ulysses", rows: int = 1,
                          documents: StageDocuments | None = None) -> float:
    """FLOPs a pipeline stage spends per token of its micro-batches: its layers', and the last stage's ends.
    Full recomputation runs each layer's forward again up to its last saved input (torch.utils.checkpoint
    stops early), i.e. all but the last matmul; selective recomputes the sequence mixing's forward. Under
    context parallelism by the latent (mla="latent", cp > 1) MLA layers add latent_exchange_flops_per_token
    (`rows`: the micro-batch's sequences). documents: MLA priced by the stage's documents (None: one per row)."""
    keys = documents.keys if documents else None
    flops = sum(layer_flops_per_token(cfg, i, seq_len, keys) for i in layers)
    if recompute == "full":
        flops += sum(layer_flops_per_token(cfg, i, seq_len, keys) / 3 - 2 * final_projection_params(cfg, i)
                     for i in layers)
    elif recompute == "selective":
        flops += sum(mixing_flops_per_token(cfg, i, seq_len, keys) for i in layers) / 3
    mla_layers = [i for i in layers if cfg.layer_kind(i) == "mla"]
    # Attention's backward recomputes the scores: 2.5 forwards, not 2 (torch's FLOP formulas count it so).
    flops += sum(mixing_flops_per_token(cfg, i, seq_len, keys) / 6 for i in mla_layers)
    if cp > 1 and mla == "latent":
        flops += len(mla_layers) * latent_exchange_flops_per_token(cfg, seq_len, cp, recompute, rows, documents)
    return flops + 6 * ends_params(cfg, last)


def count(cfg: ModelConfig, seq_len: int) -> dict:
    d = cfg.hidden_size
    per_layer_vectors = 3 * 2 * d  # two AttnRes mixes (query + norm weight) and two pre-norms
    breakdown = {
        "embedding": cfg.vocab_size * d,
        "vision_tower": vision_tower_params(cfg.vision.encoder, cfg.vision.patch_size, cfg.vision.channels),
        "mm_projector": vision_projector_params(cfg.vision.encoder, d),
        "head": d * cfg.vocab_size,
        "final_mix_and_norm": 3 * d,
        "layer_norms_and_mixes": (cfg.num_layers + cfg.mtp.layers) * per_layer_vectors,
        "kda": 0, "mla": 0, "dense_mlp": 0,
        "router": 0, "latent_projections": 0, "routed_experts": 0, "shared_experts": 0,
        # Each multi-token-prediction block: two input norms, the projection, the norm before the shared head;
        # its decoder layer is counted with the backbone's (indices num_layers on).
        "mtp_blocks": cfg.mtp.layers * (2 * d * d + 3 * d),
    }
    moe_layers = 0
    layers = range(cfg.num_layers + cfg.mtp.layers)
    for i in layers:
        if cfg.layer_kind(i) == "kda":
            breakdown["kda"] += kda_params(d, cfg.kda)
        else:
            breakdown["mla"] += mla_params(d, cfg.mla)
        if cfg.is_moe_layer(i):
            moe_layers += 1
            for key, value in moe_params(d, cfg.moe).items():
                breakdown[key] += value
        else:
            breakdown["dense_mlp"] += situ_glu_params(d, cfg.dense_intermediate)
    total = sum(breakdown.values())
    idle_experts = moe_layers * (cfg.moe.num_experts - cfg.moe.top_k) * routed_expert_params(cfg.moe)
    active = total - idle_experts

    layer_flops = [layer_flops_per_token(cfg, i, seq_len) for i in layers]
    mixing = [mixing_flops_per_token(cfg, i, seq_len) for i in layers]
    flops = sum(layer_flops) + 6 * ends_params(cfg, last=True)
    kda = sum(f for i, f in zip(layers, mixing) if cfg.layer_kind(i) == "kda")
    return {
        "total_params": total,
        "active_params": active,
        "flops_per_token": flops,
        "seq_len": seq_len,
        "moe_layers": moe_layers,
        "breakdown": breakdown,
        "flops_breakdown": {
            "dense_matmuls": flops - sum(mixing),
            "mla_attention": sum(mixing) - kda,
            "kda_mixing": kda,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--layout", metavar="tp=A,pp=B,ep=C,dp=D",
                        help="add each pipeline stage's worst rank's parameter, gradient and optimizer bytes")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config_or_exit(args)
    result = count(cfg.model, cfg.data.seq_len)
    if args.layout:
        from moe_pretrain.planning.rank_state import describe, per_rank_bytes

        try:
            result["per_rank"] = per_rank_bytes(cfg, args.layout)
        except ConfigError as err:
            print(f"sizing: {err}", file=sys.stderr)
            return EX_CONFIG
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"total params   {result['total_params']:.4e} ({total_parts(cfg.model, cfg.data.seq_len)})")
        print(f"active params  {result['active_params']:.4e}")
        print(f"train FLOPs/token at T={result['seq_len']}  {result['flops_per_token']:.4e}")
        for key, value in result["breakdown"].items():
            print(f"  {key:22s} {value:.4e}")
        if args.layout:
            print(describe(result["per_rank"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
