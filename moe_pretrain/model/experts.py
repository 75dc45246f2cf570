"""Routed SiTU-GLU experts, stored stacked and computed only on the rows routed to each expert.

Shape legend: E experts (E / ep on an expert-parallel rank), L latent width (experts read and write
latent vectors), F expert intermediate, R routed rows grouped by expert. w_gate_EFL, w_up_EFL, w_down_ELF.

Under autocast the stacked weights are cast to the compute dtype once per optimizer step and reused by every
micro-batch (model/weight_casts.py: autocast's own weight cache only holds leaf tensors, and an expert's
slice w[e] is not one). The matmuls are ops.grouped_mm, whose backward writes the stacked weight gradients
directly.
"""

import torch
from torch import nn

from moe_pretrain.fp8.experts import Fp8Experts, fp8_grouped_mm
from moe_pretrain.fp8.recipes import RECIPES
from moe_pretrain.model.init import Normal
from moe_pretrain.model.weight_casts import cast_weights
from moe_pretrain.ops import grouped_mm, situ_glu


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, intermediate: int, *, beta: float,
                 linear_beta: float, init_std: float, out_std: float):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w_down = nn.Parameter(torch.empty(num_experts, latent, intermediate))
        self.param_init = {"w_gate": Normal(init_std), "w_up": Normal(init_std), "w_down": Normal(out_std)}
        self.fp8: Fp8Experts | None = None
        """precision.fp8's settings (enable_fp8, below); None: the GEMMs run in the compute dtype."""

    def compute_weights(self, device_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate, w_up, w_down) in autocast's dtype (weight_casts.cast_weights: once per step inside the
        trainer's casts_reused region); the parameters themselves outside autocast."""
        weights = (self.w_gate, self.w_up, self.w_down)
        if not torch.is_autocast_enabled(device_type):
            return weights
        return cast_weights(self, weights, torch.get_autocast_dtype(device_type))

    def forward(self, x_RL: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_RL: rows grouped by expert; counts [E] rows per expert (summing to R) -> [R, L].

        Grouped matmuls (ops.grouped_mm: one grouped GEMM, or one matmul per expert): experts with no rows
        cost nothing.
        """
        w_gate, w_up, w_down = self.compute_weights(x_RL.device.type)
        x_RL = x_RL.to(w_gate.dtype)
        gate, up = self._matmul(x_RL, w_gate, counts, "gate"), self._matmul(x_RL, w_up, counts, "up")
        h = situ_glu(gate, up, self.beta, self.linear_beta)
        return self._matmul(h.to(w_down.dtype), w_down, counts, "down")

    def _matmul(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, name: str) -> torch.Tensor:
        if self.fp8 is None:
            return grouped_mm(x_RI, w_EOI, counts)
        return fp8_grouped_mm(x_RI, w_EOI, counts, self.fp8, name)


def enable_fp8(model: nn.Module, recipe: str, amax_history: int) -> int:
    """Give every routed-experts module of the model its FP8 settings (recipe 'off' clears them);
    returns how many modules it set. It lives with the experts, not in moe_pretrain.fp8, so that the FP8
    package never imports the model."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        module.fp8 = None if recipe == "off" else Fp8Experts(RECIPES[recipe], amax_history)
    return len(experts)
