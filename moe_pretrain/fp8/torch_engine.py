"""The FP8 expert GEMM as a loop of one scaled matmul per expert: the `torch` engine (kernels.fp8_gemm), which
runs anywhere torch does (CPU included) and is the reference the fused engines are compared with. The loop
reads the counts on the host, as TE's grouped linear does with its m_splits."""

import torch

from moe_pretrain.fp8.experts import Fp8Experts
from moe_pretrain.fp8.quantize import scaled_matmul


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EOI, counts, fp8, name):
        out = x_RI.new_empty(x_RI.shape[0], w_EOI.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                out[rows] = scaled_matmul(fp8.quantize(x_RI[rows], f"{name}.x", e), fp8.weight(w_EOI, name, e),
                                          x_RI.dtype)
            start += n
        ctx.save_for_backward(x_RI, w_EOI)
        ctx.counts, ctx.fp8, ctx.name = counts, fp8, name
        return out

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_EOI = ctx.saved_tensors
        grad_x, grad_w = fp8_backward_loop(ctx.fp8, ctx.name, x_RI, w_EOI, grad_RO, ctx.counts)
        return grad_x, grad_w, None, None, None


def fp8_backward_loop(fp8: Fp8Experts, name: str, x_RI: torch.Tensor, w_EOI: torch.Tensor, grad_RO: torch.Tensor,
                      counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of the FP8 grouped GEMM, one expert at a time: dx = dy W contracted over O, dW = dy^T x over
    the expert's rows (an expert with no rows gets a zero gradient)."""
    grad_x, grad_w = torch.zeros_like(x_RI), torch.zeros_like(w_EOI)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            dy = grad_RO[rows]
            grad_x[rows] = scaled_matmul(fp8.quantize(dy, f"{name}.dy", e, grad=True),
                                         fp8.weight(w_EOI, name, e, transposed=True), x_RI.dtype)
            grad_w[e] = scaled_matmul(fp8.quantize(dy.T, f"{name}.dy", e, grad=True),
                                      fp8.quantize(x_RI[rows].T, f"{name}.x", e), w_EOI.dtype)
        start += n
    return grad_x, grad_w


def torch_grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts,
                     name: str) -> torch.Tensor:
    """fp8_grouped_mm's contract through this engine."""
    split = fp8.host.expert_rows(counts, x_RI.shape[0])
    if sum(split) != x_RI.shape[0]:
        raise ValueError(f"fp8_grouped_mm: counts {split} must sum to the {x_RI.shape[0]} rows")
    return _Fp8GroupedMM.apply(x_RI, w_EOI, split, fp8, name)
