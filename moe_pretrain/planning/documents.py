"""The keys an attention query sees, from a stage's real data: attention stays inside a document, so its cost
follows the documents' lengths, not the row's.

A row packed with documents of lengths L_1 .. L_n gives its queries sum L (L + 1) / 2 keys in all (causal,
within each document), L / 2 per query on average where one document fills the row, far fewer where many
short ones do (model/counts.attended_keys, the mean over a batch). The plan prices MLA's attention at one
document per row unless told otherwise (a bound: the user's data decides); the dry run attends over the
documents the stage's loader packs, so the plan that is set beside it takes this figure from the same loader
(bench/dry_run.py, launch.plan --traces).
"""

import bisect

import torch

from moe_pretrain.config import Config
from moe_pretrain.data.batch import PretrainingData
from moe_pretrain.model.layout import document_starts
from moe_pretrain.planning.sizing import LATENT_KEY_BLOCK, ExchangeSpan

SAMPLE_ROWS = 64
"""Rows of the stage's first step read for the figure (the packer plans them from document lengths alone)."""


def _rank_span(bounds: list[int], rows: int, seq_len: int, cp: int, rank: int, block: int) -> tuple[int, int]:
    """(keys expanded, keys met summed over the queries) of cp rank `rank` on one micro-batch of `rows` rows.
    Its local positions are fragments rank and 2 cp - 1 - rank of each row (parallel/context_parallel.py),
    tiled by `block` in local order; a tile may see the key blocks from the one holding its earliest query's
    document start to the one holding its latest query (ops/latent_attention.py's visibility, in closed form)."""
    F = seq_len // (2 * cp)
    fragments = (rank, 2 * cp - 1 - rank)
    local = rows * 2 * F

    def position(i: int) -> int:
        row, within = divmod(i, 2 * F)
        return row * seq_len + fragments[within // F] * F + within % F

    keys = rows * seq_len
    expanded: set[int] = set()
    met = 0
    for q0 in range(0, local, block):
        q1 = min(q0 + block, local)
        # positions rise within each fragment: a tile's extremes lie at its ends and its fragments' ends
        edges = [q0, q1 - 1] + [e for k in range(q0 // F + 1, (q1 - 1) // F + 1) for e in (k * F - 1, k * F)]
        positions = [position(i) for i in edges]
        start = bounds[bisect.bisect_right(bounds, min(positions)) - 1]
        seen = range(start // block, max(positions) // block + 1)
        expanded.update(seen)
        met += (q1 - q0) * sum(min((b + 1) * block, keys) - b * block for b in seen)
    return sum(min((b + 1) * block, keys) - b * block for b in expanded), met


def exchange_span(doc_ids: torch.Tensor, rows: int, cp: int, block: int = LATENT_KEY_BLOCK) -> ExchangeSpan:
    """MLA's latent exchange over rows doc_ids [B, T] taken `rows` at a time as micro-batches, per local token
    and averaged over the cp ranks (sizing.ExchangeSpan)."""
    B, T = doc_ids.shape
    expanded = met = 0
    for first in range(0, B - rows + 1, rows):
        bounds = document_starts(doc_ids[first:first + rows]).tolist()
        for rank in range(cp):
            e, m = _rank_span(bounds, rows, T, cp, rank, block)
            expanded, met = expanded + e, met + m
    local = (B // rows) * cp * rows * T / cp
    return ExchangeSpan(expanded / local, met / local)


def stage_doc_ids(cfg: Config, stage: int, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """The document numbers [rows, seq_len] of the first `rows` rows stage `stage` (an index into cfg.stages)
    draws from its data."""
    data = PretrainingData(cfg)
    data.set_stage(stage)
    return data.next_batch(rows, with_patches=False).doc_ids
