"""How a parameter is laid out across ranks, read from the marks the parallel set-up leaves on it."""

from torch import nn


def is_expert_parameter(param: nn.Parameter) -> bool:
    """Routed-expert weights: reduced over expert-data parallel, split over expert parallel."""
    return getattr(param, "is_expert", False)


def tensor_parallel_dim(param: nn.Parameter) -> int | None:
    """The dimension a tensor-parallel parameter is sliced along, or None when it is replicated."""
    return getattr(param, "tensor_parallel_dim", None)
