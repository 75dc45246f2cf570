"""FP8 expert GEMMs in a short training run: the loss stays within a small gap of bf16's."""

import pytest

from tests.fp8_cases import (
    LOSS_GAP,
    loss_gaps,
    losses_with_fp8,
)


@pytest.mark.timeout(240)
def test_fp8_training_stays_within_a_small_loss_gap_of_bf16(tmp_path):
    # e5m2 gradients with history; power-of-two blocks (all four recipes measured)
    losses, first = losses_with_fp8(tmp_path, ("off", "delayed", "mxfp8"))
    assert losses["off"] < first - 0.5, losses
    gaps = loss_gaps(losses)
    assert all(gap <= LOSS_GAP for gap in gaps.values()), f"gaps to bf16 {gaps}, losses {losses}"
