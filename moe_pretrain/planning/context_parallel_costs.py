"""What a sequence mixer's context-parallel strategy costs, by mixer kind: the FLOPs it adds, the buffers it holds,
the bytes it sends (the planner's side of parallel/context_parallel_mixers.PLACEMENTS; model/mixer_spec.py).

KDA (split FragmentRows): no FLOPs and no buffers beyond its activations; it sends the entry states' fp32 state
summaries [H, K, K + V] (scan_summaries) and the halos of its q, k, v convolutions. Gated MLA: Ulysses'
head-for-position all-to-all (q, k, v out and the output back: 3 Dqk + Dv per head and position, each way once
a pass) with its four buffers, or the latent exchange (ops/latent_attention.py: the fragments each rank sees
sent forward and their gradients back, one expanded key block and one tile of scores held, and the FLOPs of
expanding the keys a rank's queries may see). Under recomputation by module an exchange inside a recomputed
region runs again in the backward: KDA's halos inside kda_pre, its entry states and Ulysses' exchanges inside
core; MLA's latent gather sits in none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_pretrain.config import ModelConfig
from moe_pretrain.config.stage import Stage
from moe_pretrain.planning.tensor_parallel_traffic import ring_share
from parallel.context_parallel import SCAN_FROM_CP

if TYPE_CHECKING:
    from moe_pretrain.planning.sizing import StageDocuments

LATENT_KEY_BLOCK = 1024
"""ops.latent_attention's key block (and query tile): a tile meets each key block it may see whole."""


def scan_summaries(cp: int, rank: int | None = None) -> tuple[float, float]:
    """(sent, received): the state summaries cp rank `rank` hands its collectives for KDA's entry states, and those
    it receives (parallel/context_parallel.entry_states), in one pass; rank None: the average over the ranks.
    Below SCAN_FROM_CP the all-gather's 2 cp each way. From it the scan's: over 2 cp fragments, a shift by one,
    then rounds at distance 1, 2, 4, ... below 2 cp, each fragment sending to the one `distance` after it where
    there is one (rank r's fragments r and 2 cp - 1 - r)."""
    n = 2 * cp
    if cp < SCAN_FROM_CP:
        return n, n
    distances = [1, *(2**i for i in range((n - 1).bit_length()))]
    if rank is None:
        each = sum(n - d for d in distances) / cp
        return each, each
    fragments = (rank, n - 1 - rank)
    return (sum(j + d < n for d in distances for j in fragments),
            sum(j - d >= 0 for d in distances for j in fragments))


class ContextParallelCost:
    """One mixer kind's context-parallel costs, per layer (cp > 1); a mixer without context parallelism has none."""

    def flops(self, m: ModelConfig, stage: Stage, rows: int, documents: StageDocuments | None) -> float:
        """FLOPs per local token the strategy adds to the layer (rows: the micro-batch's sequences)."""
        return 0.0

    def buffers(self, m: ModelConfig, stage: Stage, tokens: float, tp: int, act_bytes: int) -> float:
        """Bytes of the exchange's buffers while one layer runs (tokens: this rank's positions of a micro-batch)."""
        return 0.0

    def sent_bytes(self, m: ModelConfig, stage: Stage, tokens: float, tp: int, act_bytes: int, passes: int,
                   modules: frozenset[str], documents: StageDocuments | None) -> float:
        """Bytes one GPU sends for the layer in one micro-batch (passes: 2, or 3 with full recomputation)."""
        return 0.0


class KDAContextParallel(ContextParallelCost):
    def sent_bytes(self, m: ModelConfig, stage: Stage, tokens: float, tp: int, act_bytes: int, passes: int,
                   modules: frozenset[str], documents: StageDocuments | None) -> float:
        k = m.kda
        core_passes, pre_passes = (3 if name in modules else passes for name in ("core", "kda_pre"))
        rows = tokens * stage.cp / stage.seq_len
        inner = k.num_heads / tp * k.head_dim
        sent, received = scan_summaries(stage.cp, documents.cp_rank if documents else None)
        return ring_share(stage.cp, ((core_passes - 1) * sent + received) * rows * inner * 2 * k.head_dim * 4) \
            + pre_passes * ring_share(stage.cp, 3 * 2 * stage.cp * rows * (k.conv_size - 1) * inner * act_bytes)


class MLAContextParallel(ContextParallelCost):
    def flops(self, m: ModelConfig, stage: Stage, rows: int, documents: StageDocuments | None) -> float:
        """Under the latent exchange each rank expands the keys and values of the blocks its queries may see (the
        kv up-projection: forward, again in the backward, and its two gradient products; once more for full
        recomputation) instead of its own positions', and its score tiles are whole key blocks, so a query meets
        more keys than the plain layer's attention is priced at. documents with a span: both from the stage's
        documents; otherwise one document per row (all cp x its positions expanded; the causal half plus half a
        block, or every key of the micro-batch's `rows` rows when one block holds them all)."""
        if stage.cp_mla != "latent":
            return 0.0
        a, seq_len, full = m.mla, stage.seq_len, stage.recompute == "full"
        up = a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        span = documents.span() if documents else None
        expanded = span.expanded_keys if span else stage.cp
        expand = (10 if full else 8) * expanded * up - (8 if full else 6) * up
        if span:
            extra = span.tile_keys - documents.keys
        elif rows * seq_len <= LATENT_KEY_BLOCK:
            extra = rows * seq_len - seq_len / 2
        else:
            extra = min(seq_len, (seq_len + LATENT_KEY_BLOCK) / 2) - seq_len / 2
        tiles = 3.5 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * extra
        return expand + tiles * (4.5 / 3.5 if full else 1.0)  # recomputation: a forward more

    def buffers(self, m: ModelConfig, stage: Stage, tokens: float, tp: int, act_bytes: int) -> float:
        a = m.mla
        qk, heads = a.qk_nope_head_dim + a.qk_rope_head_dim, a.num_heads / tp
        if stage.cp_mla == "latent":  # one key block expanded, one tile's scores (fp32, x3 in backward)
            return LATENT_KEY_BLOCK * heads * (qk + a.v_head_dim) * 4 * 2 \
                + LATENT_KEY_BLOCK * heads * LATENT_KEY_BLOCK * 4 * 3
        return 4 * tokens * heads * qk * act_bytes

    def sent_bytes(self, m: ModelConfig, stage: Stage, tokens: float, tp: int, act_bytes: int, passes: int,
                   modules: frozenset[str], documents: StageDocuments | None) -> float:
        a = m.mla
        if stage.cp_mla == "latent":  # the fragments seen, sent forward (and re-forward), their gradients back
            span = documents.span() if documents else None
            sent, received = (span.sent_keys, span.received_keys) if span else (stage.cp - 1, stage.cp - 1)
            return ring_share(stage.cp, ((passes - 1) * sent + received) * tokens
                              * (a.kv_lora_rank + a.qk_rope_head_dim) * act_bytes)
        core_passes = 3 if "core" in modules else passes
        head_dims = 3 * (a.qk_nope_head_dim + a.qk_rope_head_dim) + a.v_head_dim
        return core_passes * 2 * ring_share(stage.cp, tokens * a.num_heads / tp * head_dims * act_bytes)


CONTEXT_PARALLEL_COSTS: dict[str, ContextParallelCost] = {"kda": KDAContextParallel(), "mla": MLAContextParallel()}
"""By mixer kind (model/mixers.MIXERS); a kind without an entry has no context-parallel strategy."""
NO_CONTEXT_PARALLEL = ContextParallelCost()


def context_parallel_cost(m: ModelConfig, index: int) -> ContextParallelCost:
    return CONTEXT_PARALLEL_COSTS.get(m.layer_kind(index), NO_CONTEXT_PARALLEL)
