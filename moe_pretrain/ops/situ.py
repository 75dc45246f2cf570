"""SiTU-GLU, the bounded gated activation of the Stable LatentMoE experts (MODEL.md).

SiTU_b(g) = b * tanh(g / b) * sigmoid(g); u' = b_lin * tanh(u / b_lin); h = SiTU_b(g) * u'.
Both factors are bounded (|SiTU_b| < b, |u'| < b_lin), so |h| <= b * b_lin = 100 at the default
b = 4, b_lin = 25: no expert can emit an activation spike, whatever its weights do.
"""

import torch

from moe_pretrain.ops.norms import compute_dtype


def situ(gate: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    """SiTU_b(g) = b * tanh(g / b) * sigmoid(g), in the input dtype's compute precision."""
    g = gate.to(compute_dtype(gate.dtype))
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)).to(gate.dtype)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """h = SiTU_beta(gate) * linear_beta * tanh(up / linear_beta); computed in >= fp32, returned in gate's dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"situ_glu: beta ({beta}) and linear_beta ({linear_beta}) must be positive")
    dtype = compute_dtype(gate.dtype)
    g = gate.to(dtype)
    u = up.to(dtype)
    h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return h.to(gate.dtype)
