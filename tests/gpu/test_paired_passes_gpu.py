"""One micro-batch's forward beside another's backward (parallel.overlap_micro_batches) on a GPU: the forward's
thread enters the caller's device and stream, the backward runs on the autograd engine's device thread, and the
paired step is bitwise the unpaired one under bf16 autocast, as on gloo (tests/distributed/test_paired_passes.py)."""

import pytest

from moe_pretrain.operations.run_loop import run_training
from parallel.paired_passes import pairs_run
from parallel.state import ParallelContext
from tests.training_cases import bf16_trainer


@pytest.mark.timeout(300)
def test_the_paired_step_on_the_gpu_is_bitwise_the_unpaired(tmp_path):
    ctx = ParallelContext.single("cuda")
    losses = {}
    for name, extra in (("unpaired", ()), ("paired", ("parallel.overlap_micro_batches=true",))):
        before = pairs_run()
        trainer = bf16_trainer(tmp_path / name, 3, "bfloat16", ctx, "data.micro_batches=4", *extra)
        losses[name] = [(h["loss"], h["grad_norm"]) for h in run_training(trainer)]
        assert (pairs_run() > before) == (name == "paired")  # the paired run ran pairs, the other none
    assert losses["paired"] == losses["unpaired"]
