"""Activation recomputation (train.recompute): keep a region's inputs, not its intermediates, and run it
again during backward (torch.utils.checkpoint, non-reentrant).

none: everything saved. full: each decoder layer keeps only its inputs (Megatron's "full" with one layer per
block). Otherwise a comma-separated list of modules, each recomputed on its own (Megatron's recompute_modules,
DeepSeek-V3's norms and MLA up-projection):
- attn_res: the AttnRes mixes (each keeps the bank entries it reads, which every mix shares, not its
  stacked, normed and weighted copies: 3 d + 2 elements per entry read);
- norms: the sublayers' pre-norms (with attn_res, one region from the bank to the normed input);
- kda_pre: KDA's pre-ops from its projections to the chunked op's inputs (short convolutions, SiLU, L2 norms,
  decay gate, beta);
- mla_up: MLA's up-projections from the latents (q and kv norms, up-projections, rotary, the key's
  concatenation); with core, one region from the latents to the attention's output, so the expanded heads
  are not kept either;
- core: the attention cores (KDA's chunked op, MLA's per-document attention);
- experts: the routed experts' MLP;
- expert_act: the experts' SiTU-GLU output is not kept for the down projection but rebuilt from the gate and
  up rows (which its own backward keeps) when the down projection's backward needs it (Megatron's
  CheckpointWithoutOutput): no GEMM runs twice.
selective is core and experts. A region that sits inside another chosen one is not recomputed twice. Under any
recomputation but none the vision tower's blocks are recomputed whole (model/transformer.set_recompute).

A recomputed forward must not count anything twice: routers and dispatchers check recomputing() before
they record balancing statistics or loads (the second pass computes the same routing, since the bias
only moves after the optimizer step).
"""

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint

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


class _Rebuilt:
    """A saved output replaced by the recipe that makes it again: rebuilt once when the first backward node
    needs it, dropped when the last one that saved it has read it."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]):
        self.fn = fn
        self.inputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs)
        self.readers, self.value = 0, None

    def read(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad(), _recomputation():
                self.value = self.fn(*self.inputs)
        value = self.value
        self.readers -= 1
        if self.readers <= 0:
            self.value = None
        return value


@contextlib.contextmanager
def rebuilt_when_saved(enabled: bool, output: torch.Tensor, fn: Callable[..., torch.Tensor],
                       *inputs: torch.Tensor) -> Iterator[None]:
    """While active, the ops that save `output` (= fn(*inputs)) for their backward keep fn and its inputs
    instead, and the output is computed again when their backward runs (expert_act). Worth it only where the
    inputs are kept anyway (by fn's own backward): then the output's bytes are not held between the passes.
    Every other saved tensor passes through as it is. Not inside another region's checkpoint (its own hooks
    would be hidden)."""
    if not (enabled and torch.is_grad_enabled()):
        yield
        return
    recipe = _Rebuilt(fn, inputs)
    output_ref = weakref.ref(output)  # autograd keeps the hooks with what they packed: they must not keep it

    def pack(t: torch.Tensor):
        # the output itself, or the whole of it flattened (a linear layer saves its 3-D input as [B T, F])
        output = output_ref()
        if output is not None and (t is output or (t._base is output and t.numel() == output.numel()
                                                   and t.is_contiguous())):
            recipe.readers += 1
            return recipe, t.shape
        return t

    def unpack(saved):
        if isinstance(saved, tuple):
            recipe, shape = saved
            return recipe.read().view(shape)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
