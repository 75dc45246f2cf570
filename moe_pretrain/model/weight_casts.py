"""The routed experts' stacked weights cast to the compute dtype once per optimizer step (step_reuse.py)."""

import torch
from torch import nn

from moe_pretrain.step_reuse import reused


def cast_weights(owner: nn.Module, weights: tuple[torch.Tensor, ...], dtype: torch.dtype
                 ) -> tuple[torch.Tensor, ...]:
    """weights in dtype (differentiable: each micro-batch's backward flows through the same cast into the
    parameters), reused within the open reused_in_step() region, cast afresh outside one. Keyed by grad mode
    too: a copy cast without grad has no path back to the parameters."""
    return reused(("cast", owner, dtype, torch.is_grad_enabled()), lambda: tuple(w.to(dtype) for w in weights))
