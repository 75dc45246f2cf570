"""What quantile balancing holds per rank for one step (model/balancing.py), for the memory plan.

histogram (the default): int64 counts [experts, bins] per MoE layer for the whole step, plus, while one
micro-batch is binned, its margins (fp32) and their bin numbers (int64), [tokens, experts] each.
exact: every micro-batch's router scores (fp32, [tokens, experts]) and choices (int64, [tokens, top_k])
kept until the step ends, for every MoE layer; then one layer's scores concatenated once more, and its
margins, while its quantile is found.
What the balancers all-reduce over their group (parallel/statistics.py) once a step: the histogram's counts of a
pipeline stage's MoE layers in one collective; aux_free's expert loads per layer; the exact quantile's
bisection per layer, a round per bit of the scores' integer image (32 for fp32) beside the token count
and the two extremes.
"""

from moe_pretrain.config import MoEConfig

SCORE_BYTES = 4
INDEX_BYTES = 8


def held_bytes(moe: MoEConfig, moe_layers: int, tokens: float, micro_batches: int) -> float:
    """Bytes the balancers of `moe_layers` MoE layers keep through a step that routes `tokens` per
    micro-batch on this rank, `micro_batches` of them (0 without quantile balancing)."""
    if moe.balancing != "qb":
        return 0.0
    if moe.qb_quantile == "histogram":
        return moe_layers * moe.num_experts * moe.qb_bins * INDEX_BYTES
    return moe_layers * tokens * micro_batches * (moe.num_experts * SCORE_BYTES + moe.top_k * INDEX_BYTES)


def balancing_bytes(moe: MoEConfig, moe_layers: int, tokens: float, micro_batches: int) -> float:
    """Peak bytes of balancing statistics: what is held, plus the largest transient (above)."""
    if moe.balancing != "qb" or moe_layers == 0:
        return 0.0
    E = moe.num_experts
    if moe.qb_quantile == "histogram":
        transient = tokens * E * (SCORE_BYTES + INDEX_BYTES)
    else:
        transient = 2 * tokens * micro_batches * E * SCORE_BYTES
    return held_bytes(moe, moe_layers, tokens, micro_batches) + transient


BISECTION_ROUNDS = 32
"""The exact quantile's bisection rounds: one per bit of fp32 scores' integer image."""


def reduced_bytes(moe: MoEConfig, moe_layers: int) -> float:
    """Payload the balancers of `moe_layers` MoE layers all-reduce in a step (int64 counts and loads)."""
    if moe_layers == 0 or moe.balancing == "aux_loss":
        return 0.0
    E = moe.num_experts
    if moe.balancing == "aux_free":
        return moe_layers * E * INDEX_BYTES
    if moe.qb_quantile == "histogram":
        return held_bytes(moe, moe_layers, 0.0, 0)
    return moe_layers * (1 + (2 + BISECTION_ROUNDS) * E) * INDEX_BYTES
