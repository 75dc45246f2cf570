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
