"""SiTU-GLU, the bounded gated activation of the Stable LatentMoE experts (docs/model.md).

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


class _SiTUGLU(torch.autograd.Function):
    """h = SiTU_b(g) * u' saving only g and u (in their own dtype): the backward recomputes the few
    elementwise factors, so a routed expert keeps two [R, F] tensors for backward instead of about ten
    (the expert activations grow with tokens x top-k x F)."""

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.betas = beta, linear_beta
        dtype = compute_dtype(gate.dtype)
        g, u = gate.to(dtype), up.to(dtype)
        return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
                ).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_h):
        gate, up = ctx.saved_tensors
        beta, linear_beta = ctx.betas
        dtype = compute_dtype(gate.dtype)
        g, u, grad = gate.to(dtype), up.to(dtype), grad_h.to(dtype)
        t, s = torch.tanh(g / beta), torch.sigmoid(g)
        tu = torch.tanh(u / linear_beta)
        # d SiTU/dg = (1 - t^2) s + b t s (1 - s);  d u'/du = 1 - tanh^2(u / b_lin)
        grad_gate = grad * linear_beta * tu * ((1 - t * t) * s + beta * t * s * (1 - s))
        grad_up = grad * beta * t * s * (1 - tu * tu)
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype), None, None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the fused kernel (gpu_kernels/situ_glu.py, Kernels.triton) takes; float64 stays here."""


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0, *, fused: bool = False
) -> torch.Tensor:
    """h = SiTU_beta(gate) * linear_beta * tanh(up / linear_beta); computed in >= fp32, returned in gate's dtype.
    fused: our Triton kernel (Kernels.triton) for the dtypes it takes."""
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"situ_glu: beta ({beta}) and linear_beta ({linear_beta}) must be positive")
    if fused and gate.dtype in _KERNEL_DTYPES:
        from gpu_kernels.situ_glu import situ_glu as kernel

        return kernel(gate, up, beta, linear_beta)
    return _SiTUGLU.apply(gate, up, beta, linear_beta)
