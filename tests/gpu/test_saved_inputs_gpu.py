"""The layers' inputs offloaded to pinned host memory and prefetched back on a side stream (CUDA): four bf16
steps give bitwise the losses, gradient norms and weights of keeping them on the GPU, as on the CPU
(tests/unit/test_saved_inputs.py), and nothing of them stays on the GPU."""

import pytest
import torch

from parallel.state import ParallelContext
from tests.training_cases import saved_inputs_training


@pytest.mark.timeout(600)
def test_host_offload_on_the_gpu_is_bitwise(tmp_path):
    ctx = ParallelContext.single("cuda")
    history, weights, _ = saved_inputs_training(tmp_path, "device", ctx)
    host_history, host_weights, trainer = saved_inputs_training(tmp_path, "host", ctx)
    assert host_history == history
    assert all(torch.equal(host_weights[k], v) for k, v in weights.items())
    assert trainer.saved_inputs.device_bytes == 0 and trainer.saved_inputs.host_bytes > 0
