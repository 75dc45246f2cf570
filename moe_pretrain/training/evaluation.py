"""Held-out evaluation: the validation loss, and at stage ends the loss by position and a retrieval probe.

Every measure is a sum and a count over named sets of rows: a validation dataset's loss (summed next-token
loss, tokens), a position bucket's loss (the same over positions [lo, hi) of long documents), a probe
cell's accuracy (key tokens predicted top-1, keys). They are computed with the training forward (its
autocast, context-parallel split and vocabulary-parallel logits; under pipeline parallelism the stage's
schedule in forward-only mode: the step runner's score) and without gradients,
so nothing of the training state changes (routers record statistics only from forwards that train). The
rows are padded with unscored ones to whole shards and reduced like the training loss (counts over the
data x context group; sums over it, or over the world with a pipeline, where only the last stage's first
tensor rank holds them), so every value is that of one process whatever the layout.
"""

import itertools

import torch
import torch.distributed as dist

from moe_pretrain.config.stage import Stage
from moe_pretrain.data import IGNORE_INDEX, Batch
from moe_pretrain.data.long_context_eval import (
    keep_positions,
    long_document_rows,
    position_edges,
    probe_batches,
    probe_tokenizer,
)
from moe_pretrain.data.packing import RowPlan
from moe_pretrain.data.validation import ValidationData
from moe_pretrain.step_reuse import reused_in_step
from moe_pretrain.training.step_runner import StepRunner
from parallel.collectives import all_reduce_sum


class _Sums:
    """Where evaluation rows at a stage's length and split go: how many per set, in what batches, scored how."""

    def __init__(self, runner: StepRunner, stage: Stage):
        self.runner, self.stage = runner, stage
        data_parallel = runner.ctx.context(stage.cp)
        self.shard, self.shards = data_parallel.dp_rank, data_parallel.dp_size
        # A pipeline takes one pass through its schedule: whole micro-batches on every rank.
        self.multiple = self.shards * (stage.micro_batches if runner.pipeline is not None else 1)
        self.with_patches = runner.pipeline is None or runner.pipeline.holds_first

    def padded(self, rows: int) -> int:
        return -(-max(rows, 1) // self.multiple) * self.multiple

    def per_batch(self, rows: int) -> int:
        """Rows per batch on this rank: the training micro-batch's, or all of them through a pipeline."""
        if self.runner.pipeline is not None:
            return rows // self.shards
        return max(self.stage.rows // self.stage.micro_batches // self.shards, 1)

    def reduce(self, sets: dict[str, list[Batch]], rows: int, score: str) -> dict[str, tuple[float, float]]:
        """{name: (summed score, scored tokens)} over all ranks; score: loss (summed next-token loss) or top1."""
        runner = self.runner
        device = runner.ctx.device
        scorer = runner.cross_entropy_sum if score == "loss" else runner.vocabulary.top1_count
        # On the device until the one host read at the end (sums and counts of every set together).
        sums = torch.zeros(max(len(sets), 1), 2, dtype=torch.float64, device=device)
        with reused_in_step():  # no weight changes while evaluating
            for i, batches in enumerate(sets.values()):
                for batch in batches:
                    batch = batch.to(device)
                    sums[i, 1] += (runner.ctx.context(self.stage.cp).local(batch.labels) != IGNORE_INDEX).sum()
                    sums[i, 0] += runner.score(self.stage, batch, rows, scorer)
        group = dist.group.WORLD if runner.pipeline is not None else runner.ctx.dp_group
        totals = all_reduce_sum(sums[:, 0].contiguous(), group)
        counts = all_reduce_sum(sums[:, 1].contiguous(), runner.ctx.dp_group)
        values = torch.stack([totals, counts], dim=1).tolist()
        return {name: (values[i][0], values[i][1]) for i, name in enumerate(sets)}


@torch.no_grad()
def evaluate(runner: StepRunner, validation: ValidationData, stage: Stage) -> dict[str, float]:
    """{eval_loss, eval_loss.<dataset>} at the stage's sequence length (collective: every rank calls it)."""
    sums = _Sums(runner, stage)
    rows = sums.padded(validation.rows(stage.seq_len))
    sets = validation.batches(stage.seq_len, sums.shard, sums.shards, sums.per_batch(rows), sums.with_patches,
                              rows)
    reduced = sums.reduce(sets, rows, "loss")
    record = {"eval_loss": sum(s for s, _ in reduced.values()) / max(sum(c for _, c in reduced.values()), 1)}
    record.update({f"eval_loss.{name}": total / max(count, 1) for name, (total, count) in reduced.items()})
    return record


@torch.no_grad()
def evaluate_long_context(runner: StepRunner, validation: ValidationData, stage: Stage) -> dict[str, float]:
    """{eval_position_loss.<lo>-<hi>, probe_accuracy, probe_accuracy.<length>@<depth>} (collective)."""
    cfg, data, sums = runner.cfg.eval, runner.data, _Sums(runner, stage)
    record: dict[str, float] = {}
    plans = long_document_rows(data, validation.sets, stage.seq_len, cfg.long_documents)
    rows = sums.padded(len(plans))
    if plans:
        plans += [RowPlan([], stage.seq_len + 1)] * (rows - len(plans))
        mine = plans[sums.shard * (rows // sums.shards):(sums.shard + 1) * (rows // sums.shards)]
        batch = data.read_rows(mine, sums.with_patches)
        edges = position_edges(stage.seq_len, cfg.position_base)
        per_batch = sums.per_batch(rows)
        sets = {f"{lo}-{hi}": [keep_positions(batch, lo, hi).rows(i, per_batch)
                               for i in range(0, len(mine), per_batch)] for lo, hi in itertools.pairwise(edges)}
        for name, (total, count) in sums.reduce(sets, rows, "loss").items():
            record[f"eval_position_loss.{name}"] = total / max(count, 1)
    encode = probe_tokenizer(data.vocabulary)
    if encode is not None and cfg.probe_samples:
        rows = sums.padded(cfg.probe_samples)
        cells = probe_batches(data.vocabulary, encode, stage.seq_len, cfg.probe_samples, rows, runner.cfg.data.seed,
                              sums.shard, sums.shards, data.patch_dim)
        reduced = sums.reduce({name: [batch] for name, batch in cells.items()}, rows, "top1")
        record["probe_accuracy"] = sum(s for s, _ in reduced.values()) / max(sum(c for _, c in reduced.values()), 1)
        record.update({f"probe_accuracy.{name}": right / max(keys, 1) for name, (right, keys) in reduced.items()})
    return record
