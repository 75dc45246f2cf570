"""Async checkpoint staging on CUDA (moe_pretrain/checkpoint/staging.py): the copies run on a side stream after
the step's writes, and the host buffers hold exactly the values the step wrote (bitwise)."""

import torch

from moe_pretrain.checkpoint.staging import ReusedHostStager


def test_staging_copies_after_the_step_on_a_side_stream():
    stager = ReusedHostStager()
    weights = torch.zeros(1 << 22, device="cuda")
    for step in range(3):
        weights.add_(step + 1.0)  # the step's in-place write, still queued when the save is asked for
        torch.cuda._sleep(1 << 20)  # keep the training's stream busy past the request
        ready = stager.ready_event({"w": weights})
        staged = stager.stage({"w": weights}, after=ready)
        assert staged["w"].is_pinned() and torch.equal(staged["w"], weights.cpu())
    stager.close()
