"""A short training on the GPU with FP8 expert GEMMs stays within a small loss gap of bf16 (the CPU test's runs and
bound, tests/distributed/test_fp8.py), per engine: torch's (tensorwise and delayed; the forward one
torch._scaled_grouped_mm on compute capability 9.0 / 10.0) and Transformer Engine's (every recipe TE runs on this
GPU)."""

import pytest
import torch

from moe_pretrain.fp8 import RECIPES
from moe_pretrain.fp8.transformer_engine import te_unavailable_reason
from parallel.state import ParallelContext
from tests.fp8_cases import LOSS_GAP, loss_gaps, losses_with_fp8

CUDA = torch.device("cuda")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["torch", "transformer_engine"])
def test_fp8_training_on_the_gpu(tmp_path, engine):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    if engine == "torch":
        recipes = ("tensorwise", "delayed")
    else:
        recipes = tuple(name for name, recipe in RECIPES.items() if te_unavailable_reason(recipe, CUDA) is None)
        if not recipes:
            pytest.skip(f"Transformer Engine runs no recipe here: {te_unavailable_reason(RECIPES['tensorwise'], CUDA)}")
    ctx = ParallelContext.single("cuda")
    losses, _ = losses_with_fp8(tmp_path, ("off",), ctx)  # kernels.fp8_gemm names an engine of FP8 runs only
    losses.update(losses_with_fp8(tmp_path, recipes, ctx, (f"kernels.fp8_gemm={engine}",))[0])
    gaps = loss_gaps(losses)
    assert all(gap <= LOSS_GAP for gap in gaps.values()), f"{engine}: gaps to bf16 {gaps}, losses {losses}"
