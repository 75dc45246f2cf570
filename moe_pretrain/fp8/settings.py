"""One model's FP8 choice for its routed experts: the recipe, the delayed-scaling history, the GEMM engine."""

from dataclasses import dataclass
from typing import Literal

from moe_pretrain.fp8.recipes import Recipe

Engine = Literal["torch", "scaled_grouped_mm", "transformer_engine"]
"""torch: one GEMM per expert (torch._scaled_mm for single-scale operands, the exact emulation for blocked
ones; the counts read on the host, as TE's m_splits). scaled_grouped_mm: the forward as one
torch._scaled_grouped_mm (offsets on the device), the backward as torch's loop (CUDA, compute capability
9.0 / 10.0). transformer_engine: TE's grouped GEMM and quantizers (fp8/transformer_engine.py)."""


@dataclass(frozen=True)
class Fp8Settings:
    recipe: Recipe
    amax_history: int = 16
    engine: Engine = "torch"
