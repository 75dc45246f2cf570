"""Dense SiTU-GLU MLP: layer 0's MLP and the LatentMoE's shared experts (docs/model.md).

y = W_down SiTU-GLU(W_gate x, W_up x). Several shared experts summed equal one MLP whose intermediate
is their concatenation, so the shared experts are built as one MLP of num_shared * intermediate
(same parameters, same function, one GEMM instead of several).
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.recompute import rebuilt_when_saved
from moe_pretrain.ops import situ_glu


class SiTUGLUMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, *, beta: float, linear_beta: float,
                 init_std: float, out_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.fused = kernels.triton
        """SiTU-GLU through our Triton kernel (Kernels.triton)."""
        self.gate_proj = make_linear(dim, intermediate, init_std=init_std)
        self.up_proj = make_linear(dim, intermediate, init_std=init_std)
        self.down_proj = make_linear(intermediate, dim, init_std=out_std)

        self.recompute_act = False
        """Rebuild the SiTU-GLU output when the down projection's backward needs it, rather than keep it
        (train.recompute lists expert_act: the shared experts' and the dense layers' activation too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        h = self._activation(gate, up)
        with rebuilt_when_saved(self.recompute_act, h, self._activation, gate, up):
            return self.down_proj(h)

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ_glu(gate, up, self.beta, self.linear_beta, fused=self.fused)
