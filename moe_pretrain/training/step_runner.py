"""The forward and loss machinery of a step, one owner for training and for evaluation.

A StepRunner holds this rank's model, its pipeline (schedules per step shape) under pipeline parallelism,
the autocast of train.dtype and the next-token loss (vocabulary-parallel with tensor parallelism). Training
calls forward_backward (micro-batches one after another, or the pipeline schedule); evaluation calls
score (forward only, summing what its scorer gives). A pipeline schedule is built with one loss function;
the runner's computes whatever the pass under way asks for (the training loss over the step's token count,
or an evaluation's sum), set by the runner itself for the length of that pass.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_pretrain.config import Config
from moe_pretrain.config.stage import Stage
from moe_pretrain.data import IGNORE_INDEX, Batch, PretrainingData
from moe_pretrain.data.patches import placed_images
from moe_pretrain.dtypes import DTYPES
from moe_pretrain.model import MoETransformer
from moe_pretrain.model.mtp import mtp_labels
from moe_pretrain.ops.host_values import READ, HostValues
from moe_pretrain.ops.norms import compute_dtype
from moe_pretrain.step_reuse import reused_in_step
from moe_pretrain.training.pipeline import Pipeline
from parallel.paired_passes import run_paired
from parallel.state import ParallelContext
from parallel.torch_compat import without_outputs
from parallel.vocab_parallel_loss import VocabularySplit

Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits of this rank's positions and vocabulary slice, their labels) -> a summed score (0-dim)."""


@dataclass(frozen=True)
class AheadTargets:
    """The multi-token-prediction blocks' targets of a step, made once (StepRunner.ahead_labels)."""

    labels: list[torch.Tensor]
    """Per micro-batch, [B, model.mtp.layers, T]."""
    tokens: torch.Tensor
    """Per block, the step's global count of targets (each block's loss is a mean over them)."""


class StepRunner:
    def __init__(self, cfg: Config, ctx: ParallelContext, model: MoETransformer, data: PretrainingData,
                 host: HostValues = READ):
        """model: this rank's model (the whole model, or its pipeline chunks under their global names); host: how
        the values the data decides are computed (ops/host_values.py)."""
        self.cfg, self.ctx, self.model, self.data, self.host = cfg, ctx, model, data, host
        self.dtype = DTYPES[cfg.train.dtype]
        self.pipeline = Pipeline(model, cfg, ctx, self._pipeline_loss) if ctx.layout.pp > 1 else None
        self.vocabulary = VocabularySplit(ctx.tp_group if ctx.layout.tp > 1 else None)
        """Where the head's logits lie: the scores are read through it."""
        self._pipeline_pass: tuple[Callable, Callable] | None = None
        """During the pass under way (set by this runner only): what the pipeline's loss function returns,
        score(logits, labels, [(block logits, block labels)]), and what keeps this rank's positions of the
        labels (context parallel)."""

    def autocast(self):
        if self.dtype == torch.bfloat16:
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def cross_entropy_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token loss in >= fp32; with tensor parallelism the logits hold this rank's
        vocabulary slice (parallel/vocab_parallel_loss.py combines them)."""
        return self.vocabulary.cross_entropy_sum(logits.to(compute_dtype(logits.dtype)), labels)

    def ahead_labels(self, batch: Batch) -> torch.Tensor:
        """The multi-token-prediction blocks' targets of a batch, [B, model.mtp.layers, T] (model/mtp.py)."""
        return mtp_labels(batch.labels, batch.doc_ids, self.cfg.model.mtp.layers)

    def forward_backward(self, stage: Stage, batches: list[Batch], loss_tokens: torch.Tensor,
                         ahead: AheadTargets | None = None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches, every loss over the step's global count of loss
        tokens (each multi-token-prediction block's over its own, `ahead`'s, weighted by model.mtp.loss_weight);
        returns [1 + model.mtp.layers] (float64, on the device): this rank's next-token
        loss (without a pipeline the rank's micro-batches' sum, with one its share of the global mean, non-zero
        on the last stage's first tensor rank only), then each block's summed cross-entropy (on the same ranks)."""
        weight, depth = self.cfg.model.mtp.loss_weight, self.cfg.model.mtp.layers

        def objective(logits: torch.Tensor, labels: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                      parts: list[torch.Tensor], share: bool) -> torch.Tensor:
            """The loss to differentiate; appends its parts (next-token, then each block's sum) to `parts`."""
            ce_sum = self.cross_entropy_sum(logits, labels)
            sums = [self.cross_entropy_sum(block_logits, block_labels) for block_logits, block_labels in pairs]
            loss = ce_sum / loss_tokens + sum(weight * s / ahead.tokens[k] for k, s in enumerate(sums))
            parts.append(torch.stack([(ce_sum / loss_tokens if share else ce_sum).to(torch.float64),
                                      *(s.to(torch.float64) for s in sums)]).detach())
            return loss

        parts: list[torch.Tensor] = []
        if self.pipeline is not None:
            self._run_pipeline(stage, batches, stage.rows, lambda *a: objective(*a, parts=parts, share=True),
                               train=True, ahead=torch.cat(ahead.labels) if depth else None)
            if not parts or not self.pipeline.holds_last or self.ctx.tp_rank != 0:
                return torch.zeros(1 + depth, dtype=torch.float64, device=self.ctx.device)
            return torch.stack(parts).sum(0)
        local = self.ctx.context(stage.cp).local

        def forward(index: int) -> torch.Tensor:
            """Micro-batch `index`'s forward, to the loss its backward starts from."""
            batch = batches[index]
            inputs = (batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                      placed_images(batch.grids, batch.starts))
            with self.autocast():
                if depth:
                    logits, predicted, balance_loss = self.model.forward_with_mtp(*inputs)
                else:
                    (logits, balance_loss), predicted = self.model(*inputs), []
            pairs = [(block_logits, local(ahead.labels[index][:, k])) for k, block_logits in enumerate(predicted)]
            return objective(logits, local(batch.labels), pairs, parts, share=False) + balance_loss / len(batches)

        with reused_in_step():  # the parameters do not change before the optimizer step
            if self.cfg.parallel.overlap_micro_batches:
                loss = forward(0)
                for index in range(1, len(batches)):  # forward i beside backward i - 1
                    loss = run_paired(functools.partial(forward, index), loss.backward, self.ctx.device)
                loss.backward()
            else:
                for index in range(len(batches)):
                    forward(index).backward()
        return torch.stack(parts).sum(0)

    @torch.no_grad()
    def score(self, stage: Stage, batch: Batch, rows: int, scorer: Scorer) -> torch.Tensor:
        """Forward only over this rank's rows of `rows` global ones at the stage's length and split (through the
        schedule with a pipeline):
        the sum of scorer over them (float64 on the device; with a pipeline zero except on the last stage's
        first tensor rank)."""
        if self.pipeline is not None:
            return self._run_pipeline(stage, batch.split(stage.micro_batches), rows,
                                      lambda logits, labels, _: scorer(logits, labels), train=False)
        with self.autocast():
            logits, _ = self.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                                   placed_images(batch.grids, batch.starts))
        return scorer(logits, self.ctx.context(stage.cp).local(batch.labels)).to(torch.float64)

    def _run_pipeline(self, stage: Stage, micro_batches: list[Batch], rows: int, score, train: bool,
                      ahead: torch.Tensor | None = None) -> torch.Tensor:
        """Run the schedule over this rank's micro-batches; `score(logits, labels, [(block logits, block
        labels)])` gives each one's loss (this rank's positions; the blocks' pairs only with multi-token
        prediction, whose targets `ahead` [B, depth, T] travel with the labels). Returns the sum of the scores
        on the last stage's first tensor rank, zero elsewhere (float64)."""
        pipeline = self.pipeline
        pipeline.feed(micro_batches)
        with self.host.data_values():  # the library splits these back into micro-batches: real rows in a dry run
            tokens, image_mask, labels = (torch.cat([getattr(batch, name) for batch in micro_batches])
                                          for name in ("tokens", "image_mask", "labels"))
        args = (tokens, image_mask) if pipeline.holds_first else ()
        depth = self.cfg.model.mtp.layers
        if ahead is None and depth:  # evaluation: the blocks' outputs are there, without targets
            ahead = torch.full_like(labels, IGNORE_INDEX).unsqueeze(1).expand(-1, depth, -1)
        target = (torch.cat([labels.unsqueeze(1), ahead], dim=1) if depth else labels) \
            if pipeline.holds_last else None
        losses: list[torch.Tensor] = []
        schedule = pipeline.schedule(dataclasses.replace(stage, rows=rows))
        self._pipeline_pass = score, self.ctx.context(stage.cp).local
        try:
            with self.autocast(), reused_in_step():
                if train:
                    schedule.step(*args, target=target, losses=losses, **without_outputs(schedule.step))
                else:
                    schedule.eval(*args, target=target, losses=losses)
        finally:
            self._pipeline_pass = None
        if not pipeline.holds_last or self.ctx.tp_rank != 0:
            return torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        return torch.stack([loss.detach() for loss in losses]).sum().to(torch.float64)

    def _pipeline_loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage's output (the logits, or with multi-token prediction
        the logits and each block's) against the micro-batch's labels ([B, T], or [B, 1 + depth, T])."""
        score, local = self._pipeline_pass
        if not self.cfg.model.mtp.layers:
            return score(output, local(target), [])
        logits, *predicted = output
        pairs = [(block_logits, local(target[:, 1 + k])) for k, block_logits in enumerate(predicted)]
        return score(logits, local(target[:, 0]), pairs)
