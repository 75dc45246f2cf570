"""The factory through which every model projection is created (STYLE.md rule 1).

A projection declares its parallel style; the factory picks the implementation for the current
layout, so the model's math never changes when tensor parallelism arrives:
- column: output features shard over tensor-parallel ranks (q/k/v, gate/up projections);
- row: input features shard, outputs are reduced (output projections, down projections);
- replicated: every rank holds the whole weight (router, low-rank decay, AttnRes queries).
On one process all three are an ordinary nn.Linear; the weights are initialised from one master
normal(0, std) draw so a sharded layout can slice the same values.
"""

from enum import StrEnum

import torch
from torch import nn


class LinearStyle(StrEnum):
    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"


def make_linear(
    in_features: int,
    out_features: int,
    *,
    style: LinearStyle,
    bias: bool = False,
    init_std: float = 0.02,
) -> nn.Linear:
    """A Linear y = x W^T (+ b) of the requested parallel style, weights ~ N(0, init_std), bias 0."""
    if not isinstance(style, LinearStyle):
        raise TypeError(f"make_linear: style must be a LinearStyle, got {style!r}")
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, init_std)
        if bias:
            layer.bias.zero_()
    layer.parallel_style = style
    return layer
