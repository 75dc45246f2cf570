"""Bytes one GPU sends to its pipeline neighbours in one micro-batch: what training/pipeline.stage_boundaries
declares at each chunk's edges, forward to the next chunk and, as gradients, back to the previous one.

A boundary after layer L carries this rank's sequence shard (T / (cp x tp) positions) of: the bank's first
entry (the embeddings, in the compute dtype), one embedding ahead per multi-token-prediction block (the
parameter dtype: fp32 under bf16), the AttnRes blocks closed so far and the open block's partial sum (the
compute dtype). Every tensor of it is
differentiable, so the backward returns its gradient of the same size. Interleaved schedules (vpp > 1) send
at every chunk's edges.
"""

from moe_pretrain.config import ModelConfig
from moe_pretrain.training.pipeline import closes_no_block


def boundary_bytes(m: ModelConfig, last_layer_before: int, positions: float, param_bytes: int,
                   compute_bytes: int) -> float:
    """One micro-batch's boundary after layer `last_layer_before`, on one rank."""
    d = m.hidden_size
    block = m.attn_res.block_size
    values = m.mtp.layers * positions * d * param_bytes
    values += (1 + (last_layer_before + 1) // block) * positions * d * compute_bytes
    values += positions * d * compute_bytes if closes_no_block(last_layer_before, block) else 0
    return values


def pipeline_bytes(m: ModelConfig, chunks: list[list[int]], mine: list[int], positions: float, param_bytes: int,
                   compute_bytes: int) -> float:
    """Sent by one GPU in one micro-batch: chunks are every chunk's layers in pipeline order, mine the indices
    of this rank's."""
    sent = 0.0
    for c in mine:
        if c + 1 < len(chunks):  # the output forward
            sent += boundary_bytes(m, chunks[c][-1], positions, param_bytes, compute_bytes)
        if c > 0:  # the input's gradient backward
            sent += boundary_bytes(m, chunks[c - 1][-1], positions, param_bytes, compute_bytes)
    return sent
