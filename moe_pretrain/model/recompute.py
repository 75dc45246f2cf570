"""Activation recomputation (train.recompute): keep a region's inputs, not its intermediates, and run it
again during backward (torch.utils.checkpoint, non-reentrant).

none: everything saved. selective: the attention cores (KDA's chunked op, MLA's per-document attention)
and the routed experts' MLP are recomputed; their intermediates (KDA's per-chunk C x C products and
solves, the experts' F-wide activations) are most of a layer's saved bytes for a small share of its
FLOPs. full: each decoder layer keeps only its inputs (Megatron's "full" with one layer per block).

A recomputed forward must not count anything twice: routers and dispatchers check recomputing() before
they record balancing statistics or loads (the second pass computes the same routing, since the bias
only moves after the optimizer step).
"""

import contextlib
import threading
from collections.abc import Callable
from typing import Literal, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

Recompute = Literal["none", "selective", "full"]
T = TypeVar("T")

_state = threading.local()


def recomputing() -> bool:
    """True while backward re-runs a checkpointed region."""
    return getattr(_state, "active", False)


@contextlib.contextmanager
def _recomputation():
    previous = recomputing()
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def maybe_recompute(enabled: bool, fn: Callable[..., T], *args) -> T:
    """fn(*args), recomputed in backward when enabled and a graph is being built."""
    if not (enabled and torch.is_grad_enabled()):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _recomputation()))
