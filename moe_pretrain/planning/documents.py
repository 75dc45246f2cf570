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
from moe_pretrain.planning.context_parallel_costs import LATENT_KEY_BLOCK
from moe_pretrain.planning.sizing import ExchangeSpan
from parallel.latent_route import LatentRoute

SAMPLE_ROWS = 64
"""Rows of the stage's first step read for the figure (the packer plans them from document lengths alone)."""


def _rank_span(route: LatentRoute, F: int, block: int) -> tuple[int, int, int, int]:
    """(keys expanded, keys met summed over the queries, keys sent, keys received) of a cp rank on one
    micro-batch, by its route (parallel/latent_route.py; fragments of F positions). Its keys are the compact
    sequence of the fragments its queries see, its queries tiled by `block` in local order, which is that
    sequence's order too; a tile may see the key blocks from the one holding its first query's document start
    to the one holding its last query (ops/latent_attention.py's visibility, in closed form)."""
    keys, index, compact = len(route.needed) * F, route.query_index, route.bounds
    expanded: set[int] = set()
    met = 0
    for q0 in range(0, len(index), block):
        q1 = min(q0 + block, len(index))
        start = compact[bisect.bisect_right(compact, index[q0]) - 1]
        seen = range(start // block, index[q1 - 1] // block + 1)
        expanded.update(seen)
        met += (q1 - q0) * sum(min((b + 1) * block, keys) - b * block for b in seen)
    return (sum(min((b + 1) * block, keys) - b * block for b in expanded), met, sum(route.input_splits) * F,
            sum(route.output_splits) * F)


def exchange_spans(doc_ids: torch.Tensor, rows: int, cp: int, block: int = LATENT_KEY_BLOCK
                   ) -> tuple[ExchangeSpan, ...]:
    """MLA's latent exchange over rows doc_ids [B, T] taken `rows` at a time as micro-batches, per local token of
    each cp rank (sizing.ExchangeSpan)."""
    B, T = doc_ids.shape
    totals = [[0, 0, 0, 0] for _ in range(cp)]
    for first in range(0, B - rows + 1, rows):
        bounds = document_starts(doc_ids[first:first + rows]).tolist()
        for rank, route in enumerate(LatentRoute.every(bounds, rows, T, cp)):
            totals[rank] = [a + b for a, b in zip(totals[rank], _rank_span(route, T // (2 * cp), block), strict=True)]
    local = (B // rows) * rows * T / cp  # one rank's local tokens over the micro-batches
    return tuple(ExchangeSpan(*(value / local for value in total)) for total in totals)


def stage_doc_ids(cfg: Config, stage: int, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """The document numbers [rows, seq_len] of the first `rows` rows stage `stage` (an index into cfg.stages)
    draws from its data."""
    return rank_doc_ids(cfg, stage, rows, 1, 0, 1)


def rank_doc_ids(cfg: Config, stage: int, rows: int, micro_batches: int, shard: int, shards: int) -> torch.Tensor:
    """The document numbers [micro_batches x rows / shards, seq_len] a data-parallel rank (shard of shards)
    reads in stage `stage`'s first step of `micro_batches` micro-batches of `rows` rows each, as the trainer
    asks for them (training/trainer.py's batch request): the rows a traced rank ran."""
    data = PretrainingData(cfg)
    data.set_stage(stage)
    return torch.cat([data.next_batch(rows, shard, shards, with_patches=False).doc_ids for _ in range(micro_batches)])
