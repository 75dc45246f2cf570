"""Values derived from the parameters, made at most once per optimizer step and reused by every micro-batch.

Two kinds today: the matmuls' weights cast to the compute dtype (cast_for_step: every linear layer's, and the
routed experts' stacked weights, model/experts.py) and the experts' FP8 quantizations (fp8/experts.py: without
reuse every micro-batch would quantize every expert's weights again). The values live only inside
`reused_in_step()`, which the trainer opens around one step's forward and backward passes (every micro-batch, or
the pipeline schedule) and closes before the optimizer writes the parameters: a value never outlives the parameters
it was made from, whoever writes them and however (the sharded optimizer writes through flat buffers and bumps no
parameter's version counter, so a cache keyed on `_version` goes stale after the first step). Outside that region
every use makes its value afresh.

The region is process-wide rather than thread-local: on CUDA, autograd runs backward (and the forwards that
train.recompute re-runs inside it) on its own device thread, which must find the same values. It imports
nothing of the model, so both the model and the FP8 package can use it.
"""

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch

_values: dict[Hashable, object] | None = None
"""The open region's values by key; None outside any region."""
_making = False
"""A reused value is being made (once a step, whatever the step's micro-batches)."""

T = TypeVar("T")


@contextlib.contextmanager
def reused_in_step() -> Iterator[None]:
    """Within: each key's value is made once; on exit the values are dropped (the next step makes them from
    the updated parameters). Nested regions share the outermost one."""
    global _values
    if _values is not None:
        yield
        return
    _values = {}
    try:
        yield
    finally:
        _values = None


def reused(key: Hashable, make: Callable[[], T]) -> T:
    """make()'s value, made once per key within the open region; made afresh on every call outside one."""
    if _values is None:
        return make()
    if key not in _values:
        global _making
        before, _making = _making, True
        try:
            _values[key] = make()
        finally:
            _making = before
    return _values[key]  # type: ignore[return-value]


def repeats_per_micro_batch() -> bool:
    """Whether work done now repeats with each of the step's micro-batches: inside the step's region (its
    forward and backward passes), apart from making a reused value. Outside it (the optimizer, the step's
    hooks) and while making one (the weights' casts), work is done once a step: a dry run of a cut step
    scales only the first kind to a whole step's micro-batches (planning/op_census.py)."""
    return _values is not None and not _making


class _StepCast(torch.autograd.Function):
    """The step's copy of a weight, with an autograd node of this use's own: its backward casts this use's
    gradient back to the weight's dtype. One node shared by every use (a plain cast made at the step's first
    use, or autocast's cached cast) has the lowest sequence number in the graph, so autograd runs it last:
    every layer's weight gradient in the compute dtype waited for it until the backward ended."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def cast_for_step(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight in dtype: the values cast once per step (reused), each use differentiable into weight."""
    copy = reused(("cast", weight, dtype), lambda: weight.detach().to(dtype))
    return _StepCast.apply(weight, copy) if torch.is_grad_enabled() and weight.requires_grad else copy


def autocast_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A matmul's weight (or bias) as autocast would cast it, through cast_for_step: unchanged outside
    autocast or when already in its dtype."""
    if weight is None or not torch.is_autocast_enabled(weight.device.type) or not weight.is_floating_point():
        return weight
    dtype = torch.get_autocast_dtype(weight.device.type)
    return weight if weight.dtype == dtype else cast_for_step(weight, dtype)
