"""Weights cast to the compute dtype once per optimizer step, for modules whose weights autocast cannot cache.

autocast caches its casts of leaf parameters by itself, within one autocast region. The routed experts
slice their stacked weights per expert (w[e] is not a leaf), so without a cache of our own every
micro-batch would cast every expert's weights again. The copies live only inside `casts_reused()`, which
the trainer opens around one step's forward and backward passes (every micro-batch, or the pipeline
schedule) and closes before the optimizer writes the parameters: a copy never outlives the values it was
cast from, whoever writes them and however (the sharded optimizer writes through flat buffers and bumps
no parameter's version counter, so a cache keyed on `_version` goes stale after the first step). Outside
that region every use casts afresh.

The region is process-wide rather than thread-local: on CUDA, autograd runs backward (and the forwards
that train.recompute re-runs inside it) on its own device thread, which must find the same copies.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_step_copies: dict[tuple, tuple[torch.Tensor, ...]] | None = None
"""The open region's copies by (module, dtype, grad mode); None outside any region."""


@contextlib.contextmanager
def casts_reused() -> Iterator[None]:
    """Within: each module's weights are cast at most once per dtype and grad mode; on exit the copies are
    dropped (the next step casts the updated masters). Nested regions share the outermost one."""
    global _step_copies
    if _step_copies is not None:
        yield
        return
    _step_copies = {}
    try:
        yield
    finally:
        _step_copies = None


def cast_weights(owner: nn.Module, weights: tuple[torch.Tensor, ...], dtype: torch.dtype
                 ) -> tuple[torch.Tensor, ...]:
    """weights in dtype (differentiable: each micro-batch's backward flows through the same cast into the
    parameters), reused within the open casts_reused() region, cast afresh outside one."""
    if _step_copies is None:
        return tuple(w.to(dtype) for w in weights)
    key = (owner, dtype, torch.is_grad_enabled())
    copies = _step_copies.get(key)
    if copies is None:
        copies = _step_copies[key] = tuple(w.to(dtype) for w in weights)
    return copies

