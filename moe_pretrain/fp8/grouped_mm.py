"""The routed experts' FP8 grouped GEMM: one contract, three engines (precision.fp8's kernels.fp8_gemm, resolved
into fp8.settings.engine when the model is built): torch (a loop of scaled matmuls, torch_engine.py),
scaled_grouped_mm (one torch._scaled_grouped_mm, scaled_grouped_mm.py) and transformer_engine (TE's grouped
GEMM, transformer_engine.py). The engines depend on fp8/experts.py's state; nothing there depends on them."""

from collections.abc import Callable

import torch

from moe_pretrain.fp8.experts import Fp8Experts
from moe_pretrain.fp8.scaled_grouped_mm import scaled_grouped_mm
from moe_pretrain.fp8.torch_engine import torch_grouped_mm
from moe_pretrain.fp8.transformer_engine import te_grouped_mm

ENGINES: dict[str, Callable[..., torch.Tensor]] = {
    "torch": torch_grouped_mm, "scaled_grouped_mm": scaled_grouped_mm, "transformer_engine": te_grouped_mm}


def fp8_grouped_mm(x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, fp8: Fp8Experts,
                   name: str) -> torch.Tensor:
    """ops.grouped_mm's contract with FP8 GEMMs: [R, I] rows grouped by expert -> [R, O] in x's dtype.
    name keys this GEMM's delayed-scaling histories (gate, up, down); the engine is fp8.settings'."""
    if x_RI.dtype != w_EOI.dtype:
        raise ValueError(f"fp8_grouped_mm: rows are {x_RI.dtype} but weights are {w_EOI.dtype}")
    if counts.shape != (w_EOI.shape[0],):
        raise ValueError(f"fp8_grouped_mm: counts {tuple(counts.shape)} must give one count per expert "
                         f"({w_EOI.shape[0]})")
    with torch.autocast(x_RI.device.type, enabled=False):
        return ENGINES[fp8.settings.engine](x_RI, w_EOI, counts, fp8, name)
