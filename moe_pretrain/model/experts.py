"""Routed SiTU-GLU experts, stored stacked and computed only on the rows routed to each expert.

Shape legend: E experts (E / ep on an expert-parallel rank), L latent width (experts read and write
latent vectors), F expert intermediate, R routed rows grouped by expert. w_gate_EFL, w_up_EFL, w_down_ELF.

Under autocast the stacked weights are cast to the compute dtype once per optimizer step and reused by every
micro-batch (step_reuse.autocast_weight, as every linear layer's weight: autocast's own cache runs its cast
node after the whole backward). The matmuls are ops.grouped_mm, whose backward writes the stacked weight gradients
directly, or with FP8 (Kernels.fp8) moe_pretrain.fp8's grouped GEMM under the recipe and engine the module
was built with.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.fp8.experts import FP8_HISTORY, Fp8Experts, amax_buffers
from moe_pretrain.fp8.grouped_mm import fp8_grouped_mm
from moe_pretrain.model.init import Normal
from moe_pretrain.model.recompute import rebuilt_when_saved
from moe_pretrain.ops import grouped_mm, situ_glu
from moe_pretrain.step_reuse import autocast_weight


class GroupedExperts(nn.Module):
    cast_weights = ("w_gate", "w_up", "w_down")
    """Read only through autocast_weight (compute_weights) or as FP8 copies (model/linear.py cast_weight_names)."""

    def __init__(self, num_experts: int, latent: int, intermediate: int, *, beta: float,
                 linear_beta: float, init_std: float, out_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w_down = nn.Parameter(torch.empty(num_experts, latent, intermediate))
        self.param_init = {"w_gate": Normal(init_std), "w_up": Normal(init_std), "w_down": Normal(out_std)}
        self.grouped_gemm = kernels.grouped_gemm
        """ops.grouped_mm's kernel (Kernels.grouped_gemm) for the compute-dtype GEMMs."""
        self.fused = kernels.triton
        """SiTU-GLU through our Triton kernel (Kernels.triton)."""
        self.host = kernels.host
        """How the per-expert loops read the rows of each expert (ops/host_values.py)."""
        self.fp8_settings = kernels.fp8
        """precision.fp8's recipe and GEMM engine; None: the GEMMs run in the compute dtype."""
        self.recompute_act = False
        """Rebuild the SiTU-GLU output from the gate and up rows when the down GEMM's backward needs it, rather
        than keep it (train.recompute lists expert_act; not under FP8, whose down GEMM keeps its FP8 copy)."""
        for name, buffer in amax_buffers(num_experts, kernels.fp8).items():
            self.register_buffer(name, buffer, persistent=name == FP8_HISTORY)

    def compute_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate, w_up, w_down) in autocast's dtype (step_reuse.autocast_weight: once per step inside the
        trainer's reused_in_step region); the parameters themselves outside autocast."""
        return tuple(autocast_weight(w) for w in (self.w_gate, self.w_up, self.w_down))

    def forward(self, x_RL: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_RL: rows grouped by expert; counts [E] rows per expert (summing to R) -> [R, L].

        Grouped matmuls (ops.grouped_mm: one grouped GEMM, or one matmul per expert): experts with no rows
        cost nothing.
        """
        w_gate, w_up, w_down = self.compute_weights()
        x_RL = x_RL.to(w_gate.dtype)
        fp8 = None if self.fp8_settings is None else Fp8Experts(self.fp8_settings, self, self.host)
        gate, up = self._matmul(x_RL, w_gate, counts, "gate", fp8), self._matmul(x_RL, w_up, counts, "up", fp8)
        h = self._activation(gate, up, w_down.dtype)
        with rebuilt_when_saved(self.recompute_act and fp8 is None, h, self._activation, gate, up, w_down.dtype):
            return self._matmul(h, w_down, counts, "down", fp8)

    def _activation(self, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return situ_glu(gate, up, self.beta, self.linear_beta, fused=self.fused).to(dtype)

    def _matmul(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, name: str,
                fp8: Fp8Experts | None) -> torch.Tensor:
        if fp8 is None:
            return grouped_mm(x_RI, w_EOI, counts, self.grouped_gemm, self.host)
        return fp8_grouped_mm(x_RI, w_EOI, counts, fp8, name)
