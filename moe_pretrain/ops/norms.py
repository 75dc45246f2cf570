"""Normalisations used across the model (docs/model.md: RMSNorm eps 1e-5, 1e-6 inside MLA, L2 eps 1e-6).

Computed in at least fp32 whatever the activation dtype, then cast back, so bf16 training keeps
the same statistics as the fp32 reference.
"""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype numerically sensitive math runs in: fp32, or fp64 when the model itself is fp64."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, fused: bool = False,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight, in out_dtype (x's by default).
    fused: our Triton kernel (gpu_kernels/rms_norm.py: the cast folded into its write) where it applies (a
    weight, fp32 / bf16 / fp16); else this reference."""
    if fused and weight is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from gpu_kernels.rms_norm import rms_norm as kernel

        return kernel(x, weight, eps, out_dtype)
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(out_dtype or x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, *, fused: bool = False) -> torch.Tensor:
    """L2-normalise the last dimension (KDA's q and k): x / sqrt(sum(x^2) + eps). fused: RMSNorm's kernel, which
    computes the same, since x / sqrt(sum(x^2) + eps) = D^-1/2 x / sqrt(mean(x^2) + eps / D) over D channels: a
    weight of D^-1/2 everywhere and an eps of eps / D (one launch each way instead of six elementwise ops)."""
    if fused and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        D = x.shape[-1]
        return rms_norm(x, x.new_full((D,), D ** -0.5, dtype=torch.float32), eps / D, fused=True)
    xf = x.to(compute_dtype(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)
