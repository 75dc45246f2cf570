"""Router math and expert-load balancing rules of the Stable LatentMoE (docs/model.md).

Shapes: m tokens, n experts, k experts per token. scores [m, n] are sigmoid router scores in fp32 (or
fp64); bias [n] is the balancing bias, which steers selection but never the combine weights.
"""

import torch

from moe_pretrain.ops.host_values import READ, HostValues
from moe_pretrain.ops.norms import compute_dtype


def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores in >= fp32: routing decisions must not depend on the activation dtype."""
    return torch.sigmoid(logits.to(compute_dtype(logits.dtype)))


def route(
    logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float = 1.0, host: HostValues = READ
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select k experts per token by score + bias; weights are the raw scores renormalised.

    logits [m, n] -> (topk_idx [m, k] int64, topk_weight [m, k] in >= fp32, summing to `scaling`). host: the
    dry run's assumed routing replaces the choice (ops/host_values.py).
    """
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be [tokens, experts], got {tuple(logits.shape)}")
    n = logits.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"route: k={k} must be in [1, {n}] (experts)")
    scores = router_scores(logits)
    _, topk_idx = torch.topk(scores + bias.to(scores.dtype).detach(), k, dim=-1)
    topk_idx = host.routed(topk_idx, n)
    selected = scores.gather(1, topk_idx)
    topk_weight = selected / selected.sum(dim=-1, keepdim=True) * scaling
    return topk_idx, topk_weight


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [n] (int64). index_add rather than bincount: CUDA's bincount reads its
    input's maximum on the host (a sync per call)."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def quantile_balance_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """M_ij = s_ij + b_j - alpha_i, alpha_i = (k+1)-th largest biased score of token i ([m, n], >= fp32)."""
    n = scores.shape[1]
    if not 1 <= k < n:
        raise ValueError(f"quantile balancing: k={k} must be in [1, {n - 1}] for {n} experts")
    if bias.shape != (n,):
        raise ValueError(f"quantile balancing: bias must be [{n}], got {tuple(bias.shape)}")
    dtype = compute_dtype(scores.dtype)
    biased = scores.to(dtype) + bias.to(dtype)
    alpha = torch.topk(biased, k + 1, dim=1).values[:, k]
    return biased - alpha[:, None]


def quantile_balance_update(
    scores: torch.Tensor, bias: torch.Tensor, k: int, rate: float = 1.0
) -> torch.Tensor:
    """Quantile Balancing: one bias update from one batch's scores [m, n] (docs/model.md).

    alpha_i = (k+1)-th largest biased score of token i; margin M_ij = s_ij + b_j - alpha_i;
    q = floor(m * k / n); c_j = (q+1)-th largest margin of column j; b_j <- b_j - rate * c_j.
    After the update q tokens of column j have s_ij + b_j > alpha_i (relative to the old thresholds,
    ties aside), which is the load every expert would have under perfect balance.
    """
    margins = quantile_balance_margins(scores, bias, k)
    m, n = scores.shape
    q = (m * k) // n
    c = torch.topk(margins, q + 1, dim=0).values[q]
    return (bias.to(margins.dtype) - rate * c).to(bias.dtype)


def aux_free_update(load: torch.Tensor, bias: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """DeepSeek's auxiliary-loss-free rule from expert loads [n]: b_j += rate * sign(mean_load - load_j)."""
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


def load_balancing_loss(scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Classic auxiliary loss n * sum_j f_j * P_j (Switch / GShard form, on sigmoid scores).

    f_j = share of routed slots that went to expert j (no gradient); P_j = mean over tokens of the
    scores normalised per token. Equals 1 under perfect balance.
    """
    _m, n = scores.shape
    fraction = expert_load(topk_idx, n).to(scores.dtype) / topk_idx.numel()
    prob = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    return n * (fraction * prob).sum()
