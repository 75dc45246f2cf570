"""Routed SiTU-GLU experts, stored stacked and computed only on the rows routed to each expert.

Shape legend: E experts, L latent width (experts read and write latent vectors), F expert
intermediate, R routed rows grouped by expert. w_gate_EFL, w_up_EFL, w_down_ELF.
"""

import torch
from torch import nn

from moe_pretrain.ops import situ_glu


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, intermediate: int, *, beta: float,
                 linear_beta: float, init_std: float, out_std: float):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, latent).normal_(0, init_std))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, latent).normal_(0, init_std))
        self.w_down = nn.Parameter(torch.empty(num_experts, latent, intermediate).normal_(0, out_std))
        self.first_expert = 0
        """Global index of this module's first expert (non-zero when experts are split over ranks)."""
        self._mark_expert_parameters()

    def _mark_expert_parameters(self) -> None:
        # Expert parameters reduce over the expert-data-parallel group, not the data-parallel one.
        for p in self.parameters():
            p.is_expert = True

    def keep_experts(self, first: int, count: int) -> None:
        """Keep only experts [first, first + count) (expert parallelism); global indices are preserved."""
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[first:first + count].clone()))
        self.first_expert = first
        self._mark_expert_parameters()

    def forward(self, x_RL: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_RL: rows grouped by expert; counts [E] rows per expert (summing to R) -> [R, L].

        A grouped loop: experts with no rows cost nothing. (On GPU the grouped GEMM replaces it.)
        """
        outputs = []
        for e, rows in enumerate(torch.split(x_RL, counts.tolist())):
            if rows.shape[0] == 0:
                continue
            h = situ_glu(rows @ self.w_gate[e].T, rows @ self.w_up[e].T, self.beta, self.linear_beta)
            outputs.append(h @ self.w_down[e].T)
        return torch.cat(outputs) if outputs else x_RL.new_zeros(0, self.w_down.shape[1])
