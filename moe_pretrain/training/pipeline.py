"""Pipeline parallelism over torch.distributed.pipelining (1F1B, interleaved 1F1B, zero bubble, GPipe).

The layers are cut into pp x vpp contiguous chunks (parallel/plan.py, pipeline_chunks); rank r holds
chunks r, r + pp, ... (interleaved placement). Between chunks travels the AttnRes state, so a
boundary need not align with an AttnRes block: the bank stacked as [B, N, T, D], the running block
sum (zeros when a block has just closed; the receiver knows this from its first layer index), and the
document ids every stage needs for its masks. The first stage reads tokens, document ids, the image
mask and the patches padded per row (so the library can split them into micro-batches along B).

Stage boundaries are declared statically (input_args / output_args): the library's alternative,
a shape-inference forward on the first step, would run the routers and the expert all-to-alls an
extra time and count a micro-batch twice in the balancing statistics. The gradients' shapes follow from
them (torch >= 2.12 derives them from input_args / output_args; 2.10 and 2.11, the GPU image's, from the
forward's outputs), so the input_grads / output_grads arguments, which 2.10 does not have, are not passed.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from moe_pretrain.config import Config
from moe_pretrain.model import MoETransformer
from parallel.plan import chunks_of_rank, pipeline_chunks
from parallel.state import ParallelContext

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}
MULTI_STAGE = {"interleaved_1f1b", "zero_bubble"}


@dataclass(frozen=True)
class StepShape:
    """The shapes one optimizer step's micro-batches have: pipeline boundaries are declared from them."""

    seq_len: int
    rows: int
    """Global sequences per step (all micro-batches, all data-parallel ranks)."""
    micro_batches: int
    patches_per_row: int
    """Width of the per-row patch padding at the first stage (PretrainingData.max_patches_per_row)."""
    cp: int = 1
    """Context-parallel size: activations hold T / cp positions, data parallel is what cp leaves."""


def patches_from_rows(patch_rows: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
    """[B, Pmax, dim] padded per row -> [P, dim] in row-major order of image_mask."""
    counts = image_mask.sum(dim=1, keepdim=True)
    return patch_rows[torch.arange(patch_rows.shape[1], device=patch_rows.device) < counts]


class StageForward(nn.Module):
    """The forward of one chunk, with the chunk's modules (and only those) as parameters."""

    def __init__(self, chunk: MoETransformer, first_layer: int, first: bool, last: bool):
        super().__init__()
        self.chunk = chunk
        self.first, self.last = first, last
        # A block closed right before this chunk: the partial sum it receives is a placeholder.
        self.starts_block = first_layer % chunk.cfg.attn_res.block_size == 0
        self.boundary_dtype = next(chunk.parameters()).dtype
        """Activations cross stages in the parameter dtype (fp32 under bf16 autocast): static shapes."""

    def forward(self, *inputs: torch.Tensor):
        chunk = self.chunk
        if self.first:
            tokens, doc_ids, image_mask, patch_rows = inputs
            layout = chunk.layout(tokens, doc_ids)
            patches = patches_from_rows(patch_rows, image_mask) if patch_rows.shape[1] else None
            bank, partial = [chunk.embed(tokens, layout, patches, image_mask if patches is not None else None)], None
        else:
            bank_stack, partial, doc_ids = inputs
            layout = chunk.layout(doc_ids, doc_ids)
            bank = list(bank_stack.unbind(1))
            partial = None if self.starts_block else partial
        bank, partial, _ = chunk.run_layers(bank, partial, layout)  # aux_loss is refused with pp > 1
        dtype = self.boundary_dtype
        if self.last:
            return chunk.logits(bank, partial).to(dtype)
        partial = torch.zeros_like(bank[0]) if partial is None else partial
        return torch.stack([b.to(dtype) for b in bank], dim=1), partial.to(dtype).contiguous(), doc_ids


def stage_boundaries(cfg: Config, ctx: ParallelContext, shape: StepShape, layers: list[int], first: bool,
                     last: bool, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example (meta) tensors of one micro-batch at a chunk's input and output."""
    rows = shape.rows // ctx.layout.dp_at(shape.cp) // shape.micro_batches
    T, D = shape.seq_len, cfg.model.hidden_size
    local = T // shape.cp  # activations hold this context-parallel rank's positions
    block = cfg.model.attn_res.block_size

    def meta(*shape, dtype=dtype):
        # requires_grad tells the library which boundary tensors carry gradients back.
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    def boundary(bank_entries):
        return (meta(rows, bank_entries, local // ctx.layout.tp, D), meta(rows, local // ctx.layout.tp, D),
                meta(rows, T, dtype=torch.int64))

    if first:
        patch_rows = meta(rows, shape.patches_per_row, cfg.model.vision.patch_dim).requires_grad_(False)
        inputs = (meta(rows, T, dtype=torch.int64), meta(rows, T, dtype=torch.int64),
                  meta(rows, T, dtype=torch.bool), patch_rows)
    else:
        inputs = boundary(1 + layers[0] // block)
    if last:
        outputs = (meta(rows, local, cfg.model.vocab_size // ctx.layout.tp),)
    else:
        outputs = boundary(1 + (layers[-1] + 1) // block)
    return inputs, outputs


class Pipeline:
    """This rank's pipeline chunks, and a schedule per step shape: the chunks are cut once, while the
    boundary shapes (declared statically, see below) change with each context-extension stage."""

    def __init__(self, model: MoETransformer, cfg: Config, ctx: ParallelContext,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """model: this rank's chunks' modules under their global names (training/parallelize.py)."""
        self.cfg, self.ctx, self.loss_fn = cfg, ctx, loss_fn
        self.layers = pipeline_chunks(cfg)
        pp, vpp = ctx.layout.pp, ctx.layout.vpp
        self.num_stages = pp * vpp
        self.mine = chunks_of_rank(self.num_stages, pp, ctx.pp_rank)
        self.forwards = {index: StageForward(
            MoETransformer.stage_of(model, self.layers[index], first=index == 0, last=index == self.num_stages - 1),
            self.layers[index][0], index == 0, index == self.num_stages - 1) for index in self.mine}
        self.holds_first, self.holds_last = 0 in self.mine, self.num_stages - 1 in self.mine
        self.model = model
        """This rank's chunks' modules under their global names (what the optimizer and checkpoints see)."""
        self._schedules: dict[StepShape, object] = {}

    def chunk_models(self) -> list[MoETransformer]:
        """The stage views of this rank's chunks (each carries the model's sequence and context splits)."""
        return [forward.chunk for forward in self.forwards.values()]

    def schedule(self, shape: StepShape):
        if shape not in self._schedules:
            stages = []
            for index in self.mine:
                first, last = index == 0, index == self.num_stages - 1
                forward = self.forwards[index]
                inputs, outputs = stage_boundaries(self.cfg, self.ctx, shape, self.layers[index], first, last,
                                                   forward.boundary_dtype)
                stages.append(PipelineStage(
                    forward, index, self.num_stages, self.ctx.device, input_args=inputs, output_args=outputs,
                    group=self.ctx.pp_group))
            schedule_cls = SCHEDULES[self.cfg.parallel.pipeline_schedule]
            target = stages if self.cfg.parallel.pipeline_schedule in MULTI_STAGE else stages[0]
            self._schedules[shape] = schedule_cls(target, shape.micro_batches, loss_fn=self.loss_fn,
                                                  scale_grads=False)
        return self._schedules[shape]
