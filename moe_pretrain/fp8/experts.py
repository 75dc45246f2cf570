"""The routed experts' grouped GEMM in FP8, forward and backward, under one precision.fp8 recipe.

Shape legend: R rows grouped by expert (counts[e] of expert e), I in features, O out features, E experts.
y_e = x_e W_e^T; dx_e = dy_e W_e; dW_e = dy_e^T x_e. Every operand is quantized for the GEMM it enters,
along that GEMM's contracted dimension (recipes.py), from the high-precision tensors the forward saved:
weights stay high precision in the model and in checkpoints, and only the GEMM inputs are FP8. Each expert
has its own scales (as Transformer Engine's grouped linear gives each GEMM its own). An expert's FP8
weights are made once per optimizer step and reused by every micro-batch and by backward (step_reuse.py;
the weights do not change within a step, so this is exact); where the recipe's weight blocks are symmetric
(tensorwise, delayed, blockwise's 128x128) the backward's dx = dy W takes them transposed instead of a
second quantization. The GEMM itself runs in one of three engines (grouped_mm.py).

Delayed scaling keeps, per expert and per operand (x, w, dy of each of the three expert GEMMs), the largest
amax of each of its last amax_history optimizer steps in the experts module's `fp8_amax_history` buffer
[E, amax_history, 9]: checkpointed with the model (sharded over experts like the weights) and, after each
step's amaxes are reduced over the expert-data-parallel group (advance_amax_histories), identical on every
rank that holds those experts. The scale comes from the history's maximum, or from the tensor's own amax
where the history holds nothing yet (a fresh run, an expert that got no rows). The scale is fixed within a
step, so a recomputed forward (train.recompute) quantizes exactly as the original did.
"""

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.fp8.quantize import Quantized, quantize
from moe_pretrain.fp8.settings import Fp8Settings
from moe_pretrain.ops.host_values import READ, HostValues
from moe_pretrain.step_reuse import reused
from parallel.collectives import all_reduce_max

FP8_HISTORY = "fp8_amax_history"
"""The experts module's persistent delayed-scaling buffer (a checkpoint written without it loads: empty)."""
OPERANDS = tuple(f"{gemm}.{operand}" for gemm in ("gate", "up", "down") for operand in ("x", "w", "dy"))
"""The delayed-scaling history's last dimension: each expert GEMM's three quantized operands."""


def amax_buffers(num_experts: int, settings: Fp8Settings | None) -> dict[str, torch.Tensor]:
    """The experts module's delayed-scaling buffers (none for the other recipes): the history (persistent)
    and the running maximum of the step in progress (not saved: a step ends before every save)."""
    if settings is None or not settings.recipe.delayed:
        return {}
    return {FP8_HISTORY: torch.zeros(num_experts, settings.amax_history, len(OPERANDS)),
            "fp8_amax_pending": torch.zeros(num_experts, len(OPERANDS))}


class Fp8Experts:
    """One experts module's FP8 GEMMs for one forward: the settings, and the module's amax buffers."""

    def __init__(self, settings: Fp8Settings, owner: nn.Module, host: HostValues = READ):
        """host: how an engine that loops over the experts reads their rows (ops/host_values.py)."""
        self.settings, self.recipe, self.owner, self.host = settings, settings.recipe, owner, host

    def quantize(self, t: torch.Tensor, name: str, expert: int, *, weight: bool = False,
                 grad: bool = False) -> Quantized:
        recipe = self.recipe
        dtype = recipe.grad_dtype if grad else recipe.forward_dtype
        block = recipe.weight_block if weight else recipe.activation_block
        amax = self.scaling_amax(name, expert, t.detach().abs().amax().float()) if recipe.delayed else None
        return quantize(t, block, dtype, power_of_two=recipe.power_of_two, amax=amax)

    def scaling_amax(self, name: str, experts: int | slice, current: torch.Tensor) -> torch.Tensor:
        """The amax to scale this use with under delayed scaling (the history's largest; `current` where it holds
        nothing yet), recording `current` into the step in progress: for one expert (an int, current a scalar)
        or several (slice(None): every expert, current [E]). Other recipes: `current`. Device operations only."""
        if not self.recipe.delayed:
            return current
        operand = OPERANDS.index(name)
        pending = self.owner.fp8_amax_pending
        pending[experts, operand] = torch.maximum(pending[experts, operand], current)
        past = self.owner.fp8_amax_history[experts, :, operand].amax(dim=-1)
        return torch.where(past > 0, past, current)

    def weight(self, w_EOI: torch.Tensor, name: str, expert: int, *, transposed: bool = False) -> Quantized:
        """Expert `expert`'s weight quantized for the forward (transposed: for dx = dy W), made once per step."""
        def make() -> Quantized:
            if transposed and self.recipe.weight_transposable:
                return self.weight(w_EOI, name, expert).transposed()
            return self.quantize(w_EOI[expert].T if transposed else w_EOI[expert], f"{name}.w", expert, weight=True)
        return reused(("fp8-weight", self.owner, name, expert, transposed, w_EOI.dtype), make)


@torch.no_grad()
def advance_amax_histories(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                           discard: bool = False) -> int:
    """Close an optimizer step for every delayed-scaling history of the model (the trainer calls this): the
    step's amaxes, reduced (max) over `group` (the expert-data-parallel ranks, which hold the same experts) in
    ONE all-reduce for every module, join the histories and the oldest step leaves. discard: a skipped step
    (non-finite loss or gradient) records nothing, so no inf reaches a scale. Returns the modules."""
    modules = [m for m in model.modules() if getattr(m, "fp8_amax_pending", None) is not None]
    if discard:
        for module in modules:
            module.fp8_amax_pending.zero_()
    if discard or not modules:
        return len(modules)
    pending = all_reduce_max(torch.cat([m.fp8_amax_pending.reshape(-1) for m in modules]), group)
    for module, step in zip(modules, pending.split([m.fp8_amax_pending.numel() for m in modules])):
        history = module.fp8_amax_history
        history.copy_(torch.cat([history[:, 1:], step.view(-1, 1, history.shape[2])], dim=1))
        module.fp8_amax_pending.zero_()
    return len(modules)
