"""The factory through which every model projection is created (STYLE.md rule 1).

y = x W^T (+ b), weights ~ N(0, init_std), bias 0, declared rather than drawn (moe_pretrain/model/init.py).
How a projection is split over ranks is not its business: parallel/plan.py names it by module path.
"""

from torch import nn

from moe_pretrain.model.init import Constant, Normal


def make_linear(in_features: int, out_features: int, *, bias: bool = False, init_std: float = 0.02) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.param_init = {"weight": Normal(init_std), "bias": Constant(0.0)}
    return layer
