"""Pipeline parallelism over torch.distributed.pipelining (1F1B, interleaved 1F1B, zero bubble, GPipe).

Chunks. The layers are cut into pp x vpp contiguous chunks (parallel/plan.py, pipeline_chunks); rank r holds
chunks r, r + pp, ... (interleaved placement).

What crosses a boundary: the AttnRes state, so a boundary need not align with an AttnRes block: the bank (its
first entry, the embeddings, [B, T, D], and the block sums after it stacked as [B, N - 1, T, D]) and, unless a
block closes at the boundary, the running block sum; with multi-token prediction (model.mtp.layers) the
embeddings of the tokens ahead, looked up on the first stage, travel to the last stage, whose output is then
the logits and each block's logits (model/mtp.py). Each crosses in its dtype in the model: under bf16 autocast
the bank's first entry and the block sums are bf16 and the embeddings ahead fp32, so a pipeline computes what
one process does. Only floating-point tensors that the receiver uses cross: torch 2.10 and 2.11 make every
received buffer require grad (an integer tensor cannot) and refuse to send back a gradient that is None.

What each stage reads from its own batch instead: the document ids for its masks (every stage reads its rows,
without pixels), split into micro-batches by the step and handed over beforehand (Pipeline.feed) as
host-readable values, which a dry run keeps real where the library's splits would make them fake; on the first
stage the images' placements and patches, each micro-batch's a view of the step's flat [P, patch_dim]. The
first stage's positional inputs are the tokens and the image mask (the library splits them along B). Every
schedule runs each stage's forwards in micro-batch order, so each forward takes the next in turn.

Boundaries are declared from the step's shape (input_args / output_args, a Stage's), not inferred by a first
forward, which would run the routers and the expert all-to-alls an extra time and count a micro-batch twice
in the balancing statistics. torch >= 2.12 derives the gradients' shapes from them, 2.10 and 2.11 from the
forward's outputs: input_grads / output_grads, which 2.10 lacks, are not passed.
"""

from collections import deque
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from moe_pretrain.config import Config
from moe_pretrain.config.stage import Stage
from moe_pretrain.data import Batch
from moe_pretrain.data.patches import PlacedImage, placed_images
from moe_pretrain.dtypes import DTYPES
from moe_pretrain.model import MoETransformer
from moe_pretrain.training.declared_stage import DeclaredStage
from moe_pretrain.training.paired_1f1b import Paired1F1B
from parallel.activation_plan import position_counts
from parallel.plan import chunks_of_rank, pipeline_chunks
from parallel.state import ParallelContext

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}
MULTI_STAGE = {"interleaved_1f1b", "zero_bubble"}


class StageForward(nn.Module):
    """The forward of one chunk, with the chunk's modules (and only those) as parameters."""

    def __init__(self, chunk: MoETransformer, layers: list[int], first: bool, last: bool,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.chunk = chunk
        self.first, self.last = first, last
        block = chunk.cfg.attn_res.block_size
        self.sends_partial = not last and closes_no_block(layers[-1], block)
        """A block still open after this chunk's last layer: its partial sum travels on."""
        self.receives_blocks = layers[0] >= block
        """Block sums are in the bank this chunk receives (not only the embeddings)."""
        self.boundary_dtype = next(chunk.parameters()).dtype
        """The embeddings ahead's and the logits' dtype (the parameters')."""
        self.compute_dtype = compute_dtype
        """The bank's and the partial sum's (bf16 under bf16 autocast)."""
        self.images: deque[tuple[list[PlacedImage], torch.Tensor]] = deque()
        """First stage: each coming micro-batch's images, rows counted within it, and their patches
        [P, patch_dim] in row-major order (Pipeline.feed)."""
        self.documents: deque[torch.Tensor] = deque()
        """Each coming micro-batch's document ids [rows, T] (Pipeline.feed)."""
        self.ahead = chunk.cfg.mtp.layers
        """Multi-token-prediction blocks: as many embeddings of tokens ahead cross every boundary."""

    def forward(self, *inputs: torch.Tensor):
        chunk = self.chunk
        if not self.documents:
            raise RuntimeError("pipeline: a stage ran a micro-batch it was given no document ids for")
        doc_ids = self.documents.popleft()
        if self.first:
            tokens, image_mask = inputs
            if not self.images:
                raise RuntimeError("pipeline: the first stage ran a micro-batch it was given no images for")
            images, patches = self.images.popleft()
            layout = chunk.layout(tokens, doc_ids)
            bank, partial = [chunk.embed(tokens, patches if images else None, image_mask if images else None,
                                         images)], None
            ahead = chunk.embed_ahead(tokens)
        else:
            embedded, *rest = inputs  # no partial sum when a block closed right before this chunk
            ahead, rest = rest[:self.ahead], rest[self.ahead:]
            layout = chunk.layout(doc_ids, doc_ids)
            bank = [embedded, *(rest.pop(0).unbind(1) if self.receives_blocks else ())]
            partial = rest[0] if rest else None
        bank, partial, _ = chunk.run_layers(bank, partial, layout)  # aux_loss is refused with pp > 1
        if self.last and self.ahead:
            logits, predicted, _ = chunk.logits_with_mtp(bank, partial, list(ahead), layout)
            return tuple(t.to(self.boundary_dtype) for t in (logits, *predicted))
        if self.last:
            return chunk.logits(bank, partial).to(self.boundary_dtype)
        outputs = [bank[0].to(self.compute_dtype), *(a.to(self.boundary_dtype) for a in ahead)]
        if len(bank) > 1:
            outputs.append(torch.stack([b.to(self.compute_dtype) for b in bank[1:]], dim=1))
        if self.sends_partial:
            outputs.append(partial.to(self.compute_dtype).contiguous())
        return tuple(outputs)


def closes_no_block(layer: int, block_size: int) -> bool:
    """Whether an AttnRes block is still open after `layer` (0-based): the partial sum is not yet in the bank."""
    return (layer + 1) % block_size != 0


def stage_boundaries(cfg: Config, ctx: ParallelContext, shape: Stage, layers: list[int], first: bool,
                     last: bool, dtype: torch.dtype, compute_dtype: torch.dtype | None = None
                     ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example (meta) tensors of one micro-batch of a step of `shape` at a chunk's positional input and output
    (the document ids, a keyword input, are every stage's own): the embeddings ahead in `dtype`, the bank (its
    first entry, the block sums) and the partial sum in `compute_dtype` (default: `dtype`)."""
    compute_dtype = compute_dtype or dtype
    rows = shape.rows // ctx.layout.dp_at(shape.cp) // shape.micro_batches
    D = cfg.model.hidden_size
    held = position_counts(shape.seq_len, ctx.layout.tp, shape.cp)
    block = cfg.model.attn_res.block_size

    def meta(*shape, dtype=dtype):
        # requires_grad tells the library which boundary tensors carry gradients back.
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    def boundary(last_layer_before):
        positions = held.between_layers
        tensors = [meta(rows, positions, D, dtype=compute_dtype)]  # the bank's first entry
        tensors += [meta(rows, positions, D) for _ in range(cfg.model.mtp.layers)]  # the embeddings ahead
        if blocks := (last_layer_before + 1) // block:
            tensors.append(meta(rows, blocks, positions, D, dtype=compute_dtype))
        if closes_no_block(last_layer_before, block):
            tensors.append(meta(rows, positions, D, dtype=compute_dtype))
        return tuple(tensors)

    if first:
        inputs = (meta(rows, held.inputs, dtype=torch.int64), meta(rows, held.inputs, dtype=torch.bool))
    else:
        inputs = boundary(layers[0] - 1)
    if last:  # the logits, and each multi-token-prediction block's
        vocab = cfg.model.vocab_size // ctx.layout.tp  # the head's column split
        outputs = tuple(meta(rows, held.logits, vocab) for _ in range(1 + cfg.model.mtp.layers))
    else:
        outputs = boundary(layers[-1])
    return inputs, outputs


class Pipeline:
    """This rank's pipeline chunks, and a schedule per step shape: the chunks are cut once, while the
    boundary shapes (declared statically, see below) change with each context-extension stage."""

    def __init__(self, model: MoETransformer, cfg: Config, ctx: ParallelContext,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """model: this rank's chunks' modules under their global names (parallel/parallelize.py)."""
        self.cfg, self.ctx, self.loss_fn = cfg, ctx, loss_fn
        self.layers = pipeline_chunks(cfg)
        pp, vpp = ctx.layout.pp, ctx.layout.vpp
        self.num_stages = pp * vpp
        self.mine = chunks_of_rank(self.num_stages, pp, ctx.pp_rank)
        self.forwards = {index: StageForward(
            MoETransformer.stage_of(model, self.layers[index], first=index == 0, last=index == self.num_stages - 1),
            self.layers[index], index == 0, index == self.num_stages - 1, DTYPES[cfg.train.dtype])
            for index in self.mine}
        self.holds_first, self.holds_last = 0 in self.mine, self.num_stages - 1 in self.mine
        self.model = model
        """This rank's chunks' modules under their global names (what the optimizer and checkpoints see)."""
        self._schedules: dict[tuple[int, int, int, int], object] = {}
        """By step shape (Stage.shape)."""

    def feed(self, micro_batches: list[Batch]) -> None:
        """This rank's micro-batches for the next pass, in the order the schedule runs them (the library
        splits its tensors the same way: equal runs of rows): every stage's document ids, and the first
        stage's images (data.Batch's grids and starts) with their patches. A pass that raised midway leaves
        none behind for the next."""
        for forward in self.forwards.values():
            forward.documents.clear()
            forward.documents.extend(batch.doc_ids for batch in micro_batches)
        if 0 not in self.forwards:
            return
        first = self.forwards[0]
        first.images.clear()
        first.images.extend((placed_images(batch.grids, batch.starts), batch.patches) for batch in micro_batches)

    def schedule(self, shape: Stage):
        """The schedule of steps of this shape (a stage's, or an evaluation's rows at a stage's length)."""
        if shape.shape not in self._schedules:
            stages = []
            for index in self.mine:
                first, last = index == 0, index == self.num_stages - 1
                forward = self.forwards[index]
                inputs, outputs = stage_boundaries(self.cfg, self.ctx, shape, self.layers[index], first, last,
                                                   forward.boundary_dtype, forward.compute_dtype)
                stages.append(DeclaredStage(
                    forward, index, self.num_stages, self.ctx.device, input_args=inputs, output_args=outputs,
                    group=self.ctx.pp_group))
            name = self.cfg.parallel.pipeline_schedule
            schedule_cls = Paired1F1B if self.cfg.parallel.overlap_micro_batches else SCHEDULES[name]
            target = stages if name in MULTI_STAGE or self.cfg.parallel.overlap_micro_batches else stages[0]
            self._schedules[shape.shape] = schedule_cls(target, shape.micro_batches, loss_fn=self.loss_fn,
                                                  scale_grads=False)
        return self._schedules[shape.shape]
