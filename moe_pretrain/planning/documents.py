"""The keys an attention query sees, from a stage's real data: attention stays inside a document, so its cost
follows the documents' lengths, not the row's.

A row packed with documents of lengths L_1 .. L_n gives its queries sum L (L + 1) / 2 keys in all (causal,
within each document), L / 2 per query on average where one document fills the row, far fewer where many
short ones do. The plan prices MLA's attention at one document per row unless told otherwise (a bound: the
user's data decides); the dry run attends over the documents the stage's loader packs, so the plan that is set
beside it takes this figure from the same loader (bench/dry_run.py, launch.plan --traces).
"""

import torch

from moe_pretrain.config import Config
from moe_pretrain.data.batch import PretrainingData

SAMPLE_ROWS = 64
"""Rows of the stage's first step read for the figure (the packer plans them from document lengths alone)."""


def attended_keys(doc_ids: torch.Tensor) -> float:
    """Mean keys a query attends to over rows doc_ids [B, T] (each row's document numbers, non-decreasing)."""
    pairs = tokens = 0.0
    for row in doc_ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
        pairs += (lengths * (lengths + 1) / 2).sum().item()
        tokens += lengths.sum().item()
    return pairs / tokens


def stage_attended_keys(cfg: Config, stage: int, rows: int = SAMPLE_ROWS) -> float:
    """attended_keys of the first `rows` rows stage `stage` (an index into cfg.stages) draws from its data."""
    data = PretrainingData(cfg)
    data.set_stage(stage)
    return attended_keys(data.next_batch(rows, with_patches=False).doc_ids)
