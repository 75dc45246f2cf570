"""Attention Residuals mix (docs/model.md, "AttnRes"): a learned softmax over a bank of block summaries.

h = sum_i softmax_i( w . RMSNorm(V_i) ) V_i. The scores use the normalised vectors (so a large block
does not win by magnitude alone) but the mix uses the raw vectors; scores are fp32 and, unlike
dot-product attention, not scaled by 1/sqrt(d).
"""

import torch

from moe_pretrain.ops.norms import compute_dtype, rms_norm


def attn_res_mix(
    bank: torch.Tensor, pseudo_query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """Mix a bank [N, ..., d] into [..., d]; pseudo_query [d] (or [1, d]); norm_weight [d]."""
    d = bank.shape[-1]
    query = pseudo_query.reshape(-1)
    if query.numel() != d or norm_weight.numel() != d:
        raise ValueError(
            f"attn_res_mix: bank width {d} needs pseudo_query and norm_weight of {d} values, "
            f"got {query.numel()} and {norm_weight.numel()}"
        )
    dtype = compute_dtype(bank.dtype)
    normed = rms_norm(bank.to(dtype), norm_weight, eps)
    scores = normed @ query.to(dtype)  # [N, ...]
    weights = torch.softmax(scores, dim=0).to(bank.dtype)
    return (weights.unsqueeze(-1) * bank).sum(dim=0)
