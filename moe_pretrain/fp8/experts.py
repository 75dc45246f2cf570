"""The routed experts' grouped GEMM in FP8, forward and backward, under one precision.fp8 recipe.

Shape legend: R rows grouped by expert (counts[e] of expert e), I in features, O out features, E experts.
y_e = x_e W_e^T; dx_e = dy_e W_e; dW_e = dy_e^T x_e. Every operand is quantized for the GEMM it enters,
along that GEMM's contracted dimension (recipes.py), from the high-precision tensors the forward saved:
weights stay high precision in the model and in checkpoints, and only the GEMM inputs are FP8. Each expert
has its own scales (as Transformer Engine's grouped linear gives each GEMM its own). Where the recipe's
weight blocks are symmetric (tensorwise, delayed, blockwise's 128x128) the backward reuses the forward's
FP8 weights, transposed, instead of quantizing every expert's weights a second time. The loop reads the
counts on the host, as TE's grouped linear does with its m_splits.

Delayed scaling keeps, per expert and per tensor (x, w, dy of each of the three expert GEMMs), the largest
amax of each of its last amax_history optimizer steps; the scale comes from their maximum (the tensor's own
amax until a first step has ended). The scale is fixed within a step, so a recomputed forward
(train.recompute) quantizes exactly as the original did, whatever the micro-batch order. The histories
are not checkpointed: a resumed run uses current scaling for one step and rebuilds them within
amax_history steps.
"""

import torch
from torch import nn

from moe_pretrain.fp8.quantize import Quantized, quantize, scaled_matmul
from moe_pretrain.fp8.recipes import Recipe


class AmaxHistory:
    """Per (tensor name, expert): the largest amax of each of the last `length` optimizer steps, and the
    running maximum of the step in progress. The scale source for delayed scaling."""

    def __init__(self, length: int):
        self.length = length
        self._steps: dict[tuple[str, int], torch.Tensor] = {}
        self._pending: dict[tuple[str, int], torch.Tensor] = {}

    def scaling_amax(self, name: str, expert: int, current: torch.Tensor) -> torch.Tensor:
        """The amax to scale this use with (the history's largest; `current` before any step has ended), and
        record `current` into the step in progress."""
        key = (name, expert)
        pending = self._pending.get(key)
        self._pending[key] = current if pending is None else torch.maximum(pending, current)
        past = self._steps.get(key)
        return current if past is None else past.max()

    def advance(self) -> None:
        """End of an optimizer step: its amaxes join the history, the oldest beyond `length` leave."""
        for key, amax in self._pending.items():
            past = self._steps.get(key)
            entry = amax.reshape(1).float()
            self._steps[key] = entry if past is None else torch.cat([past, entry])[-self.length:]
        self._pending.clear()


class Fp8Experts:
    """One experts module's FP8 settings: the recipe, and the amax histories under delayed scaling."""

    def __init__(self, recipe: Recipe, amax_history: int):
        self.recipe = recipe
        self.history = AmaxHistory(amax_history) if recipe.delayed else None

    def quantize(self, t: torch.Tensor, name: str, expert: int, *, weight: bool = False,
                 grad: bool = False) -> Quantized:
        recipe = self.recipe
        dtype = recipe.grad_dtype if grad else recipe.forward_dtype
        block = recipe.weight_block if weight else recipe.activation_block
        amax = None
        if self.history is not None:
            amax = self.history.scaling_amax(name, expert, t.detach().abs().amax().float())
        return quantize(t, block, dtype, power_of_two=recipe.power_of_two, amax=amax)


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EOI, counts, fp8, name):
        out = x_RI.new_empty(x_RI.shape[0], w_EOI.shape[1])
        weights: dict[int, Quantized] = {}
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                weights[e] = fp8.quantize(w_EOI[e], f"{name}.w", e, weight=True)
                out[rows] = scaled_matmul(fp8.quantize(x_RI[rows], f"{name}.x", e), weights[e], x_RI.dtype)
            start += n
        ctx.save_for_backward(x_RI, w_EOI)
        ctx.counts, ctx.fp8, ctx.name = counts, fp8, name
        # Kept for dx = dy W where transposing them is exact (FP8 bytes: a quarter of the fp32 weights).
        ctx.weights = weights if fp8.recipe.weight_transposable else None
        return out

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_EOI = ctx.saved_tensors
        fp8, name = ctx.fp8, ctx.name
        grad_x, grad_w = torch.zeros_like(x_RI), torch.zeros_like(w_EOI)
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                rows = slice(start, start + n)
                dy = grad_RO[rows]
                # dx = dy W: contracted over O. dW = dy^T x: contracted over the expert's rows.
                w_T = (ctx.weights[e].transposed() if ctx.weights is not None
                       else fp8.quantize(w_EOI[e].T, f"{name}.w", e, weight=True))
                grad_x[rows] = scaled_matmul(fp8.quantize(dy, f"{name}.dy", e, grad=True), w_T, x_RI.dtype)
                grad_w[e] = scaled_matmul(fp8.quantize(dy.T, f"{name}.dy", e, grad=True),
                                          fp8.quantize(x_RI[rows].T, f"{name}.x", e), w_EOI.dtype)
            start += n
        return grad_x, grad_w, None, None, None


def fp8_grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts,
                   name: str) -> torch.Tensor:
    """ops.grouped_mm's contract with FP8 GEMMs: [R, I] rows grouped by expert -> [R, O] in x's dtype.
    name keys this GEMM's delayed-scaling histories (gate, up, down)."""
    if x_RI.dtype != w_EOI.dtype:
        raise ValueError(f"fp8_grouped_mm: rows are {x_RI.dtype} but weights are {w_EOI.dtype}")
    split = counts.tolist()
    if len(split) != w_EOI.shape[0] or sum(split) != x_RI.shape[0]:
        raise ValueError(f"fp8_grouped_mm: counts {split} must give {w_EOI.shape[0]} experts' rows summing to "
                         f"{x_RI.shape[0]}")
    with torch.autocast(x_RI.device.type, enabled=False):
        return _Fp8GroupedMM.apply(x_RI, w_EOI, split, fp8, name)


def advance_amax_histories(model: nn.Module) -> None:
    """Close an optimizer step for every delayed-scaling history in the model (the trainer calls this)."""
    for module in model.modules():
        fp8 = getattr(module, "fp8", None)
        if fp8 is not None and fp8.history is not None:
            fp8.history.advance()

