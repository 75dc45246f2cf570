"""Values derived from the parameters, made at most once per optimizer step and reused by every micro-batch.

Two kinds today: the routed experts' weights cast to the compute dtype (model/weight_casts.py: autocast's
own weight cache holds leaf tensors only, and an expert's slice w[e] is not one) and their FP8
quantizations (fp8/experts.py: without reuse every micro-batch would quantize every expert's weights
again). The values live only inside `reused_in_step()`, which the trainer opens around one step's forward
and backward passes (every micro-batch, or the pipeline schedule) and closes before the optimizer writes
the parameters: a value never outlives the parameters it was made from, whoever writes them and however
(the sharded optimizer writes through flat buffers and bumps no parameter's version counter, so a cache
keyed on `_version` goes stale after the first step). Outside that region every use makes its value afresh.

The region is process-wide rather than thread-local: on CUDA, autograd runs backward (and the forwards that
train.recompute re-runs inside it) on its own device thread, which must find the same values. It imports
nothing of the model, so both the model and the FP8 package can use it.
"""

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

_values: dict[Hashable, object] | None = None
"""The open region's values by key; None outside any region."""

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
        _values[key] = make()
    return _values[key]  # type: ignore[return-value]
