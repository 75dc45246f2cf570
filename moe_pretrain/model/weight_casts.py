"""The routed experts' stacked weights cast to the compute dtype once per optimizer step (step_reuse.py)."""

import torch

from moe_pretrain.step_reuse import cast_for_step


def cast_weights(weights: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """weights in dtype (differentiable: each micro-batch's backward flows through its own cast node into the
    parameters), reused within the open reused_in_step() region, cast afresh outside one."""
    return tuple(cast_for_step(w, dtype) for w in weights)
