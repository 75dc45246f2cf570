"""The FP8 expert GEMM's forward as ONE torch._scaled_grouped_mm: the `scaled_grouped_mm` engine.

For the single-scale recipes (tensorwise, delayed) on CUDA GPUs of compute capability 9.0 or 10.0 without
Transformer Engine (or with kernels.fp8_gemm=torch). Every expert keeps its own scales, as in the loop: an
expert's rows share one scale, given to the kernel as a row-wise scale [R] (each row its expert's), and
its weight's scale as a column-wise one [E, O]; each group is padded with zero rows to a multiple of 16
(torch's alignment) and the padded offsets stay on the device, so the forward reads nothing on the host.
torch's kernel takes e4m3 operands only, so the backward, whose gradients are e5m2 in these recipes, runs
the per-expert loop of fp8/torch_engine.py (reading the counts there, once). The bf16 output is the kernel's
(it writes bf16 only), cast to the rows' dtype.

The kernel itself has no CPU implementation: on CPU the operands this module builds are checked against
the loop's quantization (exact) and the call against torch's own shape rules (its meta function); whether
it has run on a GPU is in docs/gpu.md.
"""

import torch

from moe_pretrain.fp8.expert_rows import expert_amax, expert_of_rows, padded_groups, scatter_rows
from moe_pretrain.fp8.experts import Fp8Experts
from moe_pretrain.fp8.quantize import quantize
from moe_pretrain.fp8.recipes import Recipe
from moe_pretrain.fp8.torch_engine import fp8_backward_loop
from moe_pretrain.step_reuse import reused

CAPABILITIES = ((9, 0), (10, 0))
"""Where torch's _scaled_grouped_mm has a kernel (Hopper, datacenter Blackwell)."""
KERNEL_DTYPE = torch.float8_e4m3fn
ALIGNMENT = 16
"""Rows per group and widths in multiples of this (torch's kernel's alignment; groups are padded to it)."""


def scaled_grouped_mm_unavailable_reason(recipe: Recipe, device: torch.device,
                                         capability: tuple[int, int] | None = None,
                                         widths: tuple[int, ...] = ()) -> str | None:
    """Why this engine cannot run `recipe` on `device` for GEMMs of these in / out widths; None when it can."""
    if bad := [w for w in widths if w % ALIGNMENT]:
        return f"torch._scaled_grouped_mm needs widths in multiples of {ALIGNMENT}, not {bad}"
    if not recipe.tensorwise:
        return f"{recipe.name} has block scales; torch._scaled_grouped_mm takes one scale per row and column"
    if recipe.forward_dtype != KERNEL_DTYPE:
        return f"torch._scaled_grouped_mm takes e4m3 operands, {recipe.name} quantizes to {recipe.forward_dtype}"
    if device.type != "cuda":
        return f"torch._scaled_grouped_mm has no kernel for device {device.type}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    capability = capability or torch.cuda.get_device_capability(device)
    if capability not in CAPABILITIES:
        return f"torch._scaled_grouped_mm runs on compute capability 9.0 / 10.0, this GPU has {capability}"
    return None


def quantize_rows(x_RI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts, name: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows in e4m3, each expert's rows under one scale (its amax, or its delayed history's) ->
    (data [R, I], scale_inv [R] fp32): what the loop's per-expert tensorwise quantize gives, row for row."""
    experts = expert_of_rows(counts, x_RI.shape[0])
    amax = fp8.scaling_amax(f"{name}.x", slice(None), expert_amax(x_RI, experts, counts.shape[0]))
    rows = quantize(x_RI, (1, max(x_RI.shape[1], 1)), KERNEL_DTYPE, power_of_two=fp8.recipe.power_of_two,
                    amax=amax[experts].unsqueeze(1))
    return rows.data, rows.scale_inv[:, 0]


def stacked_weights(w_EOI: torch.Tensor, fp8: Fp8Experts, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's FP8 weight stacked (data [E, O, I], scale_inv [E, O]), made once per step."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        weights = [fp8.weight(w_EOI, name, e) for e in range(w_EOI.shape[0])]
        scales = torch.stack([q.scale_inv.reshape(()) for q in weights])
        return torch.stack([q.data for q in weights]), scales.unsqueeze(1).expand(-1, w_EOI.shape[1]).contiguous()
    return reused(("fp8-stacked", fp8.owner, name, w_EOI.dtype), make)


def grouped_call(x_data: torch.Tensor, x_scale_R: torch.Tensor, w_data_EOI: torch.Tensor,
                 w_scale_EO: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._scaled_grouped_mm over the groups (ends `offsets`, rows past the last unused): rows row-major,
    weights column-major ([E, I, O] view of the [E, O, I] stack), bf16 out."""
    return torch._scaled_grouped_mm(x_data, w_data_EOI.transpose(-2, -1), x_scale_R, w_scale_EO, offs=offsets,
                                    out_dtype=torch.bfloat16)


class _ScaledGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EOI, counts, fp8, name):
        x_data, x_scale = quantize_rows(x_RI, counts, fp8, name)
        w_data, w_scale = stacked_weights(w_EOI, fp8, name)
        index, ends, rows = padded_groups(counts, x_RI.shape[0], ALIGNMENT)  # each group aligned, on the device
        padded = grouped_call(scatter_rows(x_data.view(torch.uint8), index, rows).view(KERNEL_DTYPE),
                              scatter_rows(x_scale, index, rows, 1.0), w_data, w_scale, ends)
        out = padded[index]
        ctx.save_for_backward(x_RI, w_EOI, counts)
        ctx.fp8, ctx.name = fp8, name
        return out.to(x_RI.dtype)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_EOI, counts = ctx.saved_tensors
        grad_x, grad_w = fp8_backward_loop(ctx.fp8, ctx.name, x_RI, w_EOI, grad_RO, counts.tolist())
        return grad_x, grad_w, None, None, None


def scaled_grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts,
                      name: str) -> torch.Tensor:
    """fp8_grouped_mm's contract through this engine."""
    return _ScaledGroupedMM.apply(x_RI.contiguous(), w_EOI, counts, fp8, name)
