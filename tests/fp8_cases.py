"""FP8 expert GEMM cases and bounds shared by the CPU tests (tests/distributed/test_fp8.py) and the GPU ones
(tests/gpu/)."""

import math
from pathlib import Path

import torch

from gpu_kernels.choice import Kernels
from moe_pretrain.fp8 import RECIPES
from moe_pretrain.fp8.settings import Fp8Settings
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import ParallelContext
from tests.models import tiny_config

COUNTS = [300, 0, 500, 200]
"""Ragged expert groups, one empty."""


FORWARD_BOUND = 0.05
"""Relative error (Frobenius) of y against float64: e4m3 keeps 3 mantissa bits (measured 0.036-0.037)."""


GRAD_BOUND = {torch.float8_e5m2: 0.08, torch.float8_e4m3fn: 0.05}
"""Of dx and dW: e5m2 gradients keep 2 mantissa bits (measured 0.059-0.060), e4m3 ones 3 (0.032-0.038)."""


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm()).item()


def experts_module(recipe: str, num_experts: int = len(COUNTS), history: int = 4, engine: str = "torch"
                   ) -> GroupedExperts:
    """An experts module built with FP8 (its delayed-scaling buffers, where the recipe keeps them)."""
    return GroupedExperts(num_experts, 8, 8, beta=4.0, linear_beta=25.0, init_std=0.02, out_std=0.02,
                          kernels=Kernels(fp8=Fp8Settings(RECIPES[recipe], history, engine)))


LOSS_GAP = 0.02
"""|mean loss of the last 5 of 20 steps, FP8 - bf16| in nats. Measured on the tiny model: tensorwise 0.0018,
delayed 0.0007, blockwise 0.0014, mxfp8 0.0010 (bf16 4.434 from 5.6 at step 1; both sides' experts now
train, tests/integration/test_bf16_training.py); the test runs two of them."""


def losses_with_fp8(tmp_path: Path, recipes: tuple[str, ...], ctx: ParallelContext | None = None,
                    extra: tuple[str, ...] = ()) -> tuple[dict[str, float], float]:
    """20 bf16 steps of the tiny model per recipe ('off' = bf16 GEMMs): ({recipe: mean loss of the last 5
    steps}, the first step's loss). Each run's weights stay fp32 and its losses finite."""
    losses, first = {}, math.nan
    for fp8 in recipes:
        cfg = tiny_config("train.steps=20", "train.dtype=bfloat16", f"precision.fp8={fp8}", *extra)
        cfg.train.run_dir, cfg.logging.progress = str(tmp_path / fp8), False
        trainer = Trainer(cfg, ctx)
        history = run_training(trainer)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # high-precision weights
        losses[fp8], first = sum(h["loss"] for h in history[-5:]) / 5, history[0]["loss"]
        assert math.isfinite(losses[fp8])
    return losses, first


def loss_gaps(losses: dict[str, float]) -> dict[str, float]:
    return {name: abs(loss - losses["off"]) for name, loss in losses.items() if name != "off"}
