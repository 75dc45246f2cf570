"""Attention Residuals mix (docs/model.md, "AttnRes"): a learned softmax over a bank of block summaries.

h = sum_i softmax_i( w . RMSNorm(V_i) ) V_i. The scores use the normalised vectors (so a large block
does not win by magnitude alone) but the mix uses the raw vectors; scores are fp32 and, unlike
dot-product attention, not scaled by 1/sqrt(d).
"""

import torch

from moe_pretrain.ops.norms import compute_dtype, rms_norm

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attn_res_mix(
    bank: list[torch.Tensor], pseudo_query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5, *,
    fused: bool = False
) -> torch.Tensor:
    """Mix a bank of N entries [..., d] into [..., d] (in the entries' promoted dtype); pseudo_query [d] (or
    [1, d]); norm_weight [d]. fused: our Triton kernel (gpu_kernels/attn_res.py: each entry read once, never
    stacked) for the dtypes it takes; else this reference."""
    d = bank[0].shape[-1]
    query = pseudo_query.reshape(-1)
    if query.numel() != d or norm_weight.numel() != d:
        raise ValueError(
            f"attn_res_mix: bank width {d} needs pseudo_query and norm_weight of {d} values, "
            f"got {query.numel()} and {norm_weight.numel()}"
        )
    if fused and all(entry.dtype in _KERNEL_DTYPES for entry in bank):
        from gpu_kernels.attn_res import attn_res_mix as kernel

        return kernel(bank, query, norm_weight, eps)
    stacked = torch.stack(bank)
    dtype = compute_dtype(stacked.dtype)
    normed = rms_norm(stacked.to(dtype), norm_weight, eps)
    scores = normed @ query.to(dtype)  # [N, ...]
    weights = torch.softmax(scores, dim=0).to(stacked.dtype)
    return (weights.unsqueeze(-1) * stacked).sum(dim=0)
