"""A short training on the GPU with FP8 expert GEMMs stays within a small loss gap of bf16."""

import math

import pytest
import torch

from moe_pretrain.training import Trainer
from parallel.state import ParallelContext
from tests.models import tiny_config

LOSS_GAP = 0.05
"""|mean loss of the last 5 of 20 steps, FP8 - bf16| in nats (the CPU test's bound, tests/test_fp8.py)."""


@pytest.mark.timeout(600)
def test_fp8_training_on_the_gpu(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    losses = {}
    for fp8 in ("off", "tensorwise", "delayed"):
        cfg = tiny_config("train.steps=20", "train.dtype=bfloat16", f"precision.fp8={fp8}")
        cfg.train.run_dir, cfg.logging.progress = str(tmp_path / fp8), False
        history = Trainer(cfg, ParallelContext.single("cuda")).run()
        losses[fp8] = sum(h["loss"] for h in history[-5:]) / 5
        assert math.isfinite(losses[fp8])
    gaps = {name: abs(loss - losses["off"]) for name, loss in losses.items() if name != "off"}
    assert all(gap <= LOSS_GAP for gap in gaps.values()), f"gaps to bf16 {gaps}, losses {losses}"
