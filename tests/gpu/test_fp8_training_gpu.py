"""A short training on the GPU with FP8 expert GEMMs stays within a small loss gap of bf16 (the CPU test's
runs and bound, tests/test_fp8.py, with the tensorwise and delayed recipes a GPU runs)."""

import pytest
import torch

from parallel.state import ParallelContext
from tests.test_fp8 import LOSS_GAP, loss_gaps, losses_with_fp8


@pytest.mark.timeout(600)
def test_fp8_training_on_the_gpu(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    losses, _ = losses_with_fp8(tmp_path, ("off", "tensorwise", "delayed"), ParallelContext.single("cuda"))
    gaps = loss_gaps(losses)
    assert all(gap <= LOSS_GAP for gap in gaps.values()), f"gaps to bf16 {gaps}, losses {losses}"
