"""Grouped matmul: rows grouped by expert times each expert's weight, y_e = x_e W_e^T.

Shape legend: R rows grouped by expert (counts[e] rows of expert e, in order), I in features, O out
features, E experts. w_EOI is the experts' stacked weight, as the model stores it.

Two implementations with one contract (the caller's `kernel`, fixed when the model is built: gpu_kernels/choice.py):
- the grouped kernel, torch._grouped_mm, forward and backward (three grouped GEMMs; the weight gradient
  is the 2-D x 2-D form, one [O, I] block per expert, zeros for an expert with no rows). The group offsets
  stay on the device: no host sync on the token counts. torch's own autograd for it fails on CPU, hence
  the Function here.
- the reference, one torch.mm per expert (it reads the counts on the host). Its backward writes each
  expert's weight gradient straight into one [E, O, I] tensor: no per-expert gradient tensors that
  autograd would later stack, and no zero-filled copy of the whole stack per expert.
"""

import functools

import torch

from moe_pretrain.ops.host_values import READ, HostValues

_ALIGNMENT_BYTES = 16


def _kernel_fails(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the three grouped GEMMs of a forward and backward once on a tiny problem: which devices and dtypes
    the installed torch's _grouped_mm takes varies by release, so ask it rather than a version table."""
    try:
        x = torch.ones(4, 8, dtype=dtype, device=device)
        w = torch.ones(2, 8, 8, dtype=dtype, device=device)
        offsets = torch.tensor([1, 4], dtype=torch.int32, device=device)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        torch._grouped_mm(x, w, offs=offsets)
        torch._grouped_mm(x.T, x, offs=offsets)
    except (RuntimeError, AttributeError, NotImplementedError) as err:
        return f"torch {torch.__version__}'s _grouped_mm fails for {dtype} on {device.type}: {str(err)[:80]}"
    return None


@functools.cache
def grouped_kernel_unavailable_reason(device: torch.device, dtype: torch.dtype, in_features: int,
                                      out_features: int) -> str | None:
    """Why torch._grouped_mm cannot run these GEMMs (forward and backward); None when it can. Cached: the
    ops ask once per device, dtype and widths, not at every GEMM."""
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA takes bfloat16, not {dtype}"
        if torch.cuda.get_device_capability(device) < (9, 0):
            return f"torch._grouped_mm needs compute capability 9.0+, {torch.cuda.get_device_name(device)} has less"
    elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes fp32 / bf16 / fp16, not {dtype}"
    size = torch.empty((), dtype=dtype).element_size()
    for name, width in (("in", in_features), ("out", out_features)):
        if width * size % _ALIGNMENT_BYTES:
            return f"{name} width {width} x {size} bytes is not a multiple of {_ALIGNMENT_BYTES} bytes"
    return _kernel_fails(device, dtype)


def uses_grouped_kernel(x_RI: torch.Tensor, w_EOI: torch.Tensor, choice: str) -> bool:
    """The kernels.grouped_gemm rule for these operands (grouped: required; auto: where it runs)."""
    if choice == "loop":
        return False
    reason = grouped_kernel_unavailable_reason(x_RI.device, x_RI.dtype, w_EOI.shape[2], w_EOI.shape[1])
    if choice == "grouped" and reason:
        raise ValueError(f"kernels.grouped_gemm=grouped cannot run: {reason}")
    return reason is None


class _GroupedKernelMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_RI, w_EOI, offsets)
        if x_RI.shape[0] == 0:
            return x_RI.new_zeros(0, w_EOI.shape[1])
        return torch._grouped_mm(x_RI, w_EOI.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_RO: torch.Tensor):
        x_RI, w_EOI, offsets = ctx.saved_tensors
        if x_RI.shape[0] == 0:
            return torch.zeros_like(x_RI), torch.zeros_like(w_EOI), None
        grad_RO = grad_RO.contiguous()
        grad_x = torch._grouped_mm(grad_RO, w_EOI, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(grad_RO.T, x_RI, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _LoopMM(torch.autograd.Function):
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


def grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, kernel: str = "auto",
               host: HostValues = READ) -> torch.Tensor:
    """[R, I] rows grouped by expert (counts [E] tensor, counts[e] rows of expert e, summing to R) -> [R, O],
    in x's dtype, which must be w's (no autocast inside: the caller chooses the compute dtype). kernel:
    grouped / loop / auto (Kernels.grouped_gemm); host: how the loop reads the counts (ops/host_values.py)."""
    if x_RI.dtype != w_EOI.dtype:
        raise ValueError(f"grouped_mm: rows are {x_RI.dtype} but weights are {w_EOI.dtype}")
    if counts.shape != (w_EOI.shape[0],):
        raise ValueError(f"grouped_mm: counts {tuple(counts.shape)} must give one count per expert ({w_EOI.shape[0]})")
    with torch.autocast(x_RI.device.type, enabled=False):
        if uses_grouped_kernel(x_RI, w_EOI, kernel):
            return _GroupedKernelMM.apply(x_RI.contiguous(), w_EOI, torch.cumsum(counts, 0, dtype=torch.int32))
        split = host.expert_rows(counts, x_RI.shape[0])
        if sum(split) != x_RI.shape[0]:
            raise ValueError(f"grouped_mm: counts {split} must sum to the {x_RI.shape[0]} rows")
        return _LoopMM.apply(x_RI, w_EOI, split)
