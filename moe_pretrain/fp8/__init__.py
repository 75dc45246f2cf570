"""FP8 for the routed experts' GEMMs (precision.fp8): recipes, quantizers and the grouped FP8 GEMM."""

from moe_pretrain.fp8.experts import Fp8Experts, advance_amax_histories
from moe_pretrain.fp8.grouped_mm import fp8_grouped_mm
from moe_pretrain.fp8.recipes import RECIPES, Recipe, fp8_unavailable_reason

__all__ = ["RECIPES", "Fp8Experts", "Recipe", "advance_amax_histories", "fp8_grouped_mm",
           "fp8_unavailable_reason"]
