"""The sizing command, `python -m moe_pretrain.planning.sizing CONFIG --json`: the model's parameter and FLOP
counts (moe_pretrain/model/counts.py); with `--layout tp=8,pp=16,ep=128,dp=32`, also each pipeline stage's
per-rank state bytes (rank_state.py). Also a pipeline stage's training FLOPs per token under a stage's
recomputation and context-parallel exchange, for the plan's step time (stage_flops_per_token).
"""

import argparse
import dataclasses
import json
import sys

from moe_pretrain.config import (
    EX_CONFIG,
    ConfigError,
    ModelConfig,
    add_config_arguments,
    load_config_or_exit,
)
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.model.counts import (
    count,
    ends_params,
    layer_flops_per_token,
    mixing_flops_per_token,
    routed_expert_params,
    total_parts,
)


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
    """What MLA's latent exchange does for one cp rank under a stage's documents (planning/documents.
    exchange_spans), per local token: the keys it expands (the key blocks of its compact key sequence some
    query tile of its may see), the keys of the blocks its query's tile meets, and the keys it sends (its
    fragments to each rank that sees them) and receives (parallel/latent_route.py). With one document per row
    the busiest ranks expand cp keys a local token and send and receive cp - 1."""
    expanded_keys: float
    tile_keys: float
    sent_keys: float
    received_keys: float


@dataclasses.dataclass(frozen=True)
class StageDocuments:
    """What a stage's documents make of MLA's attention (planning/documents.py), for the plan set beside a dry
    run: the keys a query attends to (attention stays inside a document), and under the latent exchange what
    the exchange does on each cp rank (empty: no exchange). Without it the plan prices one document per row, the
    bound. cp_rank: whose exchange the plan prices (a traced rank's); None: the busiest figures of any rank."""
    keys: float
    spans: tuple[ExchangeSpan, ...] = ()
    cp_rank: int | None = None

    def span(self) -> ExchangeSpan | None:
        if not self.spans:
            return None
        if self.cp_rank is not None:
            return self.spans[self.cp_rank]
        return ExchangeSpan(*(max(values) for values in zip(*(dataclasses.astuple(s) for s in self.spans))))


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
    span = documents.span() if documents else None
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


def module_recompute_flops_per_token(cfg: ModelConfig, index: int, seq_len: int, modules: frozenset[str],
                                     mla: str = "ulysses", keys: float | None = None) -> float:
    """The FLOPs train.recompute's modules (model/recompute.py) run again per token of layer `index`: the
    forward of a recomputed attention core (none under MLA's latent exchange, which recomputes nothing more),
    MLA's up-projections that the backward needs again, the routed experts' three GEMMs; the mixes, norms,
    KDA's pre-ops and the SiTU-GLU activation are elementwise (their time is the dry run's, not a FLOP count)."""
    a, flops = cfg.mla, 0.0
    latent = cfg.layer_kind(index) == "mla" and mla == "latent"
    if "core" in modules and not latent:
        flops += mixing_flops_per_token(cfg, index, seq_len, keys) / 3
    if "mla_up" in modules and cfg.layer_kind(index) == "mla":
        # A region's recomputation stops once it has what the backward needs (torch.utils.checkpoint): on its
        # own, mla_up's query region re-runs the up-projection only where the rotary reads it, the key-value
        # region never.
        with_core = "core" in modules and not latent
        if with_core or (a.position == "rope" and a.qk_rope_head_dim > 0):
            flops += 2 * a.q_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if with_core:
            flops += 2 * a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    if "experts" in modules and cfg.is_moe_layer(index):
        flops += 2 * cfg.moe.top_k * routed_expert_params(cfg.moe)
    return flops


def stage_flops_per_token(cfg: ModelConfig, layers: list[int], last: bool, seq_len: int, recompute: str,
                          cp: int = 1, mla: str = "ulysses", rows: int = 1,
                          documents: StageDocuments | None = None) -> float:
    """FLOPs a pipeline stage spends per token of its micro-batches: its layers', and the last stage's ends.
    Full recomputation runs each layer's forward again up to its last saved input (torch.utils.checkpoint
    stops early), i.e. all but the last matmul; recomputation by module (selective too) adds
    module_recompute_flops_per_token. Under
    context parallelism by the latent (mla="latent", cp > 1) MLA layers add latent_exchange_flops_per_token
    (`rows`: the micro-batch's sequences). documents: MLA priced by the stage's documents (None: one per row)."""
    keys = documents.keys if documents else None
    flops = sum(layer_flops_per_token(cfg, i, seq_len, keys) for i in layers)
    if recompute == "full":
        flops += sum(layer_flops_per_token(cfg, i, seq_len, keys) / 3 - 2 * final_projection_params(cfg, i)
                     for i in layers)
    else:
        modules = recompute_modules(recompute)
        flops += sum(module_recompute_flops_per_token(cfg, i, seq_len, modules, mla, keys) for i in layers)
    mla_layers = [i for i in layers if cfg.layer_kind(i) == "mla"]
    # Attention's backward recomputes the scores: 2.5 forwards, not 2 (torch's FLOP formulas count it so).
    flops += sum(mixing_flops_per_token(cfg, i, seq_len, keys) / 6 for i in mla_layers)
    if cp > 1 and mla == "latent":
        flops += len(mla_layers) * latent_exchange_flops_per_token(cfg, seq_len, cp, recompute, rows, documents)
    return flops + 6 * ends_params(cfg, last)


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
