"""bf16 training on the GPU tracks float32 (the CPU test's runs and bound, tests/integration/test_bf16_training.py): the
routed experts' compute copies follow the masters there too (cuBLAS bf16 GEMMs, CUDA autocast)."""

import pytest

from parallel.state import ParallelContext
from tests.training_cases import assert_bf16_tracks_float32, bf16_and_float32_losses


@pytest.mark.timeout(600)
def test_bf16_training_on_the_gpu_tracks_float32(tmp_path):
    assert_bf16_tracks_float32(bf16_and_float32_losses(tmp_path, ParallelContext.single("cuda")))
