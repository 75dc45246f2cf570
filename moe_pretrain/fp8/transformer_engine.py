"""The FP8 expert GEMMs through Transformer Engine: the `transformer_engine` engine (kernels.fp8_gemm).

TE's GroupedLinear owns one parameter per expert; ours are stacked [E, O, I] tensors, so this calls TE's
functional grouped GEMM (cpp_extensions.general_grouped_gemm) on lists of per-expert slices, in our own
autograd Function, with the GEMM layouts TE's GroupedLinear uses: forward TN (y = x W^T), dgrad NN
(dx = dy W), wgrad NT (dW = dy^T x). Operands are quantized by TE's quantizers, one per expert, chosen by
the recipe: tensorwise -> Float8CurrentScalingQuantizer, delayed -> Float8Quantizer with the scale of our
own amax history (fp8/experts.py: checkpointed, reduced over the expert-data-parallel ranks),
blockwise -> Float8BlockQuantizer (1x128 activations and gradients, 128x128 weights),
mxfp8 -> MXFP8Quantizer. Each expert's rows are padded with zero rows to a multiple of 16 (32 for mxfp8),
as Megatron pads its routing for FP8 (the weight gradient contracts over the rows, which cuBLAS wants
aligned), then split by expert with tex.split_quantize (m_splits: the padded counts, read on the host
once per forward, as TE's own grouped linear does); each expert's FP8 weight, rowwise for
the forward and columnwise for dgrad, is made once per optimizer step (step_reuse.py).

general_grouped_gemm's signature moved between TE 2.9 (workspaces), 2.10 and 2.11+ (quantization_params):
_grouped_gemm passes what the installed release's signature names. Transformer Engine imports only with
CUDA: nothing here runs on a CPU, and whether it has run on a GPU is in docs/gpu.md.
"""

import functools
import importlib.util
import inspect
from typing import Any

import torch

from moe_pretrain.fp8.expert_rows import expert_amax, expert_of_rows, padded_groups, scatter_rows
from moe_pretrain.fp8.experts import Fp8Experts
from moe_pretrain.fp8.quantize import scale_inv_of
from moe_pretrain.fp8.recipes import Recipe
from moe_pretrain.step_reuse import reused

_AVAILABILITY = {"tensorwise": "is_fp8_available", "delayed": "is_fp8_available",
                 "blockwise": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available"}
"""Which of TE's own checks says whether a recipe runs on this GPU."""
_ALIGNMENT = {"tensorwise": 16, "delayed": 16, "blockwise": 16, "mxfp8": 32}
"""Rows per expert group and widths in multiples of this (FP8 GEMM alignment; mxfp8's 32-element blocks)."""


@functools.cache
def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_unavailable_reason(recipe: Recipe, device: torch.device, widths: tuple[int, ...] = ()) -> str | None:
    """Why TE cannot run `recipe`'s expert GEMMs (of these in / out widths) on `device`; None when it can
    (TE's own check says)."""
    if bad := [w for w in widths if w % _ALIGNMENT[recipe.name]]:
        return f"Transformer Engine's {recipe.name} GEMMs need widths in multiples of {_ALIGNMENT[recipe.name]}, " \
            f"not {bad}"
    if device.type != "cuda":
        return f"Transformer Engine needs CUDA; device {device.type}"
    if not te_installed():
        return "transformer_engine is not installed (the NGC PyTorch image brings it)"
    try:
        import transformer_engine.pytorch as te
    except (ImportError, OSError, RuntimeError) as err:
        return f"transformer_engine.pytorch does not import: {str(err)[:120]}"
    check = getattr(te, _AVAILABILITY[recipe.name], None)
    if check is None:
        return f"this Transformer Engine has no {_AVAILABILITY[recipe.name]} (TE 2.9+ is needed)"
    available, reason = check(return_reason=True)
    capability = torch.cuda.get_device_capability(device)
    return None if available else f"Transformer Engine refuses {recipe.name} on compute capability {capability}: " \
        f"{reason}"


def _te_dtype(dtype: torch.dtype) -> Any:
    import transformer_engine_torch as tex

    return tex.DType.kFloat8E4M3 if dtype == torch.float8_e4m3fn else tex.DType.kFloat8E5M2


def _quantizer(recipe: Recipe, role: str, device: torch.device, amax: torch.Tensor | None = None) -> Any:
    """TE's quantizer for one operand (role: x, w or dy) under `recipe`; amax: delayed scaling's scalar."""
    import transformer_engine.pytorch as te

    dtype = _te_dtype(recipe.grad_dtype if role == "dy" else recipe.forward_dtype)
    if recipe.name == "tensorwise":
        return te.Float8CurrentScalingQuantizer(dtype, device, rowwise=True, columnwise=True)
    if recipe.name == "delayed":
        scale = scale_inv_of(amax, recipe.grad_dtype if role == "dy" else recipe.forward_dtype).reciprocal()
        return te.Float8Quantizer(scale.reshape(1), torch.zeros(1, device=device), dtype, rowwise=True,
                                  columnwise=True)
    if recipe.name == "blockwise":
        return te.Float8BlockQuantizer(dtype, rowwise=True, columnwise=True,
                                       block_scaling_dim=2 if role == "w" else 1)
    return te.MXFP8Quantizer(dtype, rowwise=True, columnwise=True)


def _quantizers(fp8: Fp8Experts, name: str, role: str, t: torch.Tensor, counts: torch.Tensor) -> list[Any]:
    """One quantizer per expert for operand `role` of GEMM `name` (delayed: each from its expert's history)."""
    E = counts.shape[0]
    if not fp8.recipe.delayed:
        return [_quantizer(fp8.recipe, role, t.device) for _ in range(E)]
    if role == "w":
        amax = fp8.scaling_amax(f"{name}.w", slice(None), t.detach().abs().amax(dim=(1, 2)).float())
    else:
        amax = fp8.scaling_amax(f"{name}.{role}", slice(None), expert_amax(t, expert_of_rows(counts, t.shape[0]), E))
    return [_quantizer(fp8.recipe, role, t.device, amax[e]) for e in range(E)]


def _grouped_gemm(A: list, B: list, out: list, layout: str, m_splits: list[int], *, grad: bool,
                  single_output: bool) -> None:
    """general_grouped_gemm with the arguments the installed TE release names (2.9, 2.10, 2.11+)."""
    from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

    parameters = inspect.signature(general_grouped_gemm).parameters
    extra: dict[str, Any] = {}
    if "quantization_params" in parameters:
        extra["quantization_params"] = [None] * len(A)
    if "workspaces" in parameters:
        from transformer_engine.pytorch.module.base import get_multi_stream_cublas_workspace

        extra["workspaces"] = get_multi_stream_cublas_workspace()
    general_grouped_gemm(A, B, out, out_dtype=out[0].dtype, layout=layout, m_splits=m_splits, grad=grad,
                         single_output=single_output, **extra)


class _TEGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EOI, counts, fp8, name):
        import transformer_engine_torch as tex

        multiple = _ALIGNMENT[fp8.recipe.name]
        index, ends, _ = padded_groups(counts, x_RI.shape[0], multiple)
        ends_host = ends.tolist()  # the forward's one host read: TE takes m_splits on the host
        m_splits = [b - a for a, b in zip([0, *ends_host[:-1]], ends_host)]
        x_quantizers = _quantizers(fp8, name, "x", x_RI, counts)
        inputs = tex.split_quantize(scatter_rows(x_RI, index, ends_host[-1]), m_splits, x_quantizers)

        def quantize_weights() -> list:
            quantizers = _quantizers(fp8, name, "w", w_EOI, counts)
            return [quantizer(w_EOI[e]) for e, quantizer in enumerate(quantizers)]
        weights = reused(("te-weights", fp8.owner, name, w_EOI.dtype), quantize_weights)
        out = x_RI.new_empty(ends_host[-1], w_EOI.shape[1])
        _grouped_gemm(weights, inputs, [out], "TN", m_splits, grad=False, single_output=True)
        ctx.save_for_backward(counts, index)
        ctx.inputs, ctx.weights, ctx.m_splits, ctx.fp8, ctx.name = inputs, weights, m_splits, fp8, name
        ctx.shapes = (tuple(x_RI.shape), tuple(w_EOI.shape), x_RI.dtype, w_EOI.dtype)
        return out[index]

    @staticmethod
    def backward(ctx, grad_RO):
        import transformer_engine_torch as tex

        counts, index = ctx.saved_tensors
        x_shape, w_shape, x_dtype, w_dtype = ctx.shapes
        quantizers = _quantizers(ctx.fp8, ctx.name, "dy", grad_RO, counts)
        grads = tex.split_quantize(scatter_rows(grad_RO, index, sum(ctx.m_splits)), ctx.m_splits, quantizers)
        grad_x = grad_RO.new_empty((sum(ctx.m_splits), x_shape[1]), dtype=x_dtype)
        _grouped_gemm(ctx.weights, grads, [grad_x], "NN", ctx.m_splits, grad=True, single_output=True)
        grad_w = torch.zeros(w_shape, dtype=w_dtype, device=grad_RO.device)  # an expert with no rows: zero
        _grouped_gemm(ctx.inputs, grads, list(grad_w.unbind(0)), "NT", ctx.m_splits, grad=True, single_output=False)
        return grad_x[index], grad_w, None, None, None


def te_grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts,
                  name: str) -> torch.Tensor:
    """fp8_grouped_mm's contract through Transformer Engine's grouped GEMM."""
    return _TEGroupedMM.apply(x_RI.contiguous(), w_EOI, counts, fp8, name)
