"""Grouped matmul: rows grouped by expert times each expert's weight, y_e = x_e W_e^T (the reference for a
grouped GEMM kernel).

Shape legend: R rows grouped by expert (counts[e] rows of expert e, in order), I in features, O out
features, E experts. w_EOI is the experts' stacked weight, as the model stores it.
The backward writes each expert's weight gradient straight into one [E, O, I] tensor (experts with no
rows get zeros): no per-expert gradient tensors that autograd would later stack, and no zero-filled
copy of the whole stack per expert, as indexing w[e] in the forward would cost.
"""

import torch


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = x_RI.new_empty(x_RI.shape[0], w_EOI.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(x_RI[start:start + n], w_EOI[e].T, out=out[start:start + n])
            start += n
        ctx.save_for_backward(x_RI, w_EOI)
        ctx.counts = counts
        return out

    @staticmethod
    def backward(ctx, grad_RO: torch.Tensor):
        x_RI, w_EOI = ctx.saved_tensors
        grad_RO = grad_RO.contiguous()
        grad_x = torch.empty_like(x_RI) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w_EOI) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.counts):
            rows = slice(start, start + n)
            if grad_w is not None:
                if n:
                    torch.mm(grad_RO[rows].T, x_RI[rows], out=grad_w[e])
                else:
                    grad_w[e].zero_()
            if grad_x is not None and n:
                torch.mm(grad_RO[rows], w_EOI[e], out=grad_x[rows])
            start += n
        return grad_x, grad_w, None


def grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[R, I] rows grouped by expert (counts[e] of expert e, summing to R) -> [R, O], in x's dtype, which
    must be w's (no autocast inside: the caller chooses the compute dtype)."""
    if x_RI.dtype != w_EOI.dtype:
        raise ValueError(f"grouped_mm: rows are {x_RI.dtype} but weights are {w_EOI.dtype}")
    if len(counts) != w_EOI.shape[0] or sum(counts) != x_RI.shape[0]:
        raise ValueError(f"grouped_mm: counts {counts} must give {w_EOI.shape[0]} experts' rows summing to "
                         f"{x_RI.shape[0]}")
    with torch.autocast(x_RI.device.type, enabled=False):
        return _GroupedMM.apply(x_RI, w_EOI, counts)
