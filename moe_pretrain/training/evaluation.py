"""Held-out loss: every validation dataset's summed next-token loss and token count, reduced over ranks.

The same forward as training (its autocast, context-parallel split and vocabulary-parallel loss; under
pipeline parallelism the stage's schedule in forward-only mode), without gradients, so nothing of the
training state changes (routers record statistics only from forwards that train). Sums are reduced like
the training loss: token counts over the data x context group, loss sums over the data x context group,
or over the world with a pipeline (only the last stage's first tensor rank holds them), so the values are
those of one process whatever the layout.
"""

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moe_pretrain.data import IGNORE_INDEX, Batch
from moe_pretrain.training.pipeline import StepShape
from parallel.collectives import all_reduce_sum

if TYPE_CHECKING:
    from moe_pretrain.training.trainer import StepPlan, Trainer


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@torch.no_grad()
def evaluate(trainer: "Trainer", plan: "StepPlan") -> dict[str, float]:
    """{eval_loss, eval_loss.<dataset>} at the plan's sequence length (collective: every rank calls it)."""
    ctx, validation = trainer.ctx, trainer.validation
    data_parallel = ctx.context(plan.cp)
    dp = data_parallel.dp_size
    if trainer.pipeline is None:  # batches of the training micro-batch's rows per rank
        multiple, per_batch = dp, max(plan.rows // plan.micro_batches // dp, 1)
    else:  # one pass through the schedule: whole micro-batches on every rank
        multiple = dp * plan.micro_batches
        per_batch = validation.rows(plan.seq_len, multiple) // dp
    with_patches = trainer.pipeline is None or trainer.pipeline.holds_first
    sets = validation.batches(plan.seq_len, data_parallel.dp_rank, dp, per_batch, with_patches, multiple)
    sums = torch.zeros(len(sets), 2, dtype=torch.float64)
    for i, batches in enumerate(sets.values()):
        for batch in batches:
            batch = batch.to(trainer.device)
            labels = trainer.model.context.local(batch.labels)
            sums[i, 1] += int((labels != IGNORE_INDEX).sum())
            if trainer.pipeline is None:
                sums[i, 0] += _loss_sum(trainer, batch, labels)
            else:
                sums[i, 0] += _pipeline_loss_sum(trainer, plan, batch, validation.rows(plan.seq_len, multiple))
    loss_group = dist.group.WORLD if trainer.pipeline is not None else ctx.dp_group
    losses = all_reduce_sum(sums[:, 0].contiguous(), loss_group)
    tokens = all_reduce_sum(sums[:, 1].contiguous(), ctx.dp_group)
    record = {"eval_loss": float(losses.sum() / tokens.sum().clamp(min=1))}
    for name, loss, count in zip(sets, losses.tolist(), tokens.tolist()):
        record[f"eval_loss.{name}"] = loss / max(count, 1)
    return record


def _loss_sum(trainer: "Trainer", batch: Batch, labels: torch.Tensor) -> float:
    with trainer.autocast():
        logits, _ = trainer.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask)
    return float(trainer.cross_entropy_sum(logits, labels))


def _pipeline_loss_sum(trainer: "Trainer", plan: "StepPlan", batch: Batch, rows: int) -> float:
    """This rank's share of the summed loss of `batch` (this rank's rows) through the pipeline, forward only."""
    pipeline = trainer.pipeline
    shape = StepShape(plan.seq_len, rows, plan.micro_batches, trainer.data.max_patches_per_row(plan.stage_index),
                      plan.cp)
    if pipeline.holds_first:
        args = (batch.tokens, batch.doc_ids, batch.image_mask,
                batch.patch_rows(shape.patches_per_row).to(trainer.boundary_dtype))
    else:
        args = ()
    losses: list[torch.Tensor] = []
    trainer.pipeline_loss_divisor = 1  # the schedule's loss function then returns sums
    with trainer.autocast():
        pipeline.schedule(shape).eval(*args, target=batch.labels if pipeline.holds_last else None, losses=losses)
    if not pipeline.holds_last or trainer.ctx.tp_rank != 0:
        return 0.0
    return float(torch.stack([loss.detach() for loss in losses]).sum())
