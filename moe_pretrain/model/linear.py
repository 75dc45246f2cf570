"""The factory through which every model projection is created (STYLE.md rule 1).

y = x W^T (+ b), weights ~ N(0, init_std), bias 0, declared rather than drawn (moe_pretrain/model/init.py).
How a projection is split over ranks is not its business: parallel/plan.py names it by module path.
Under autocast the weight is cast once per step (step_reuse.autocast_weight) rather than by autocast's own
cache, whose single cast node per weight autograd runs last, holding every layer's weight gradient in the
compute dtype until the backward ends.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_pretrain.model.init import Constant, Normal
from moe_pretrain.step_reuse import autocast_weight


class Linear(nn.Linear):
    """nn.Linear whose weight and bias reach the matmul through step_reuse.autocast_weight."""

    cast_weights: tuple[str, ...] = ("weight", "bias")
    """The parameters the forward reads only through autocast_weight (cast_weight_names); a layer that reads its
    weight otherwise (the router's, in fp32) sets ()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, autocast_weight(self.weight), autocast_weight(self.bias))


def make_linear(in_features: int, out_features: int, *, bias: bool = False, init_std: float = 0.02) -> nn.Linear:
    layer = Linear(in_features, out_features, bias=bias)
    layer.param_init = {"weight": Normal(init_std), "bias": Constant(0.0)}
    return layer


def cast_weight_names(model: nn.Module) -> frozenset[str]:
    """Names of the parameters every forward reads only as autocast's compute-dtype copy: those each module lists
    in its cast_weights (Linear's weight and bias, the tensor-parallel wrappers' that replace them, the routed
    experts' stacked weights). Held in bf16 under train.param_dtype=bfloat16, they compute what fp32 ones would
    under bf16 autocast."""
    return frozenset(f"{path}.{name}" if path else name for path, module in model.named_modules()
                     for name in getattr(module, "cast_weights", ()) if getattr(module, name, None) is not None)
