"""The LatentMoE router: sigmoid scores in full d, top-k by score + bias (docs/model.md).

The router always runs in >= fp32, outside any autocast, so routing never depends on the training
dtype. expert_bias is a persistent buffer (saved with the model, no gradient).
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_pretrain.config import MoEConfig
from moe_pretrain.model.balancing import make_balancer
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.recompute import recomputing
from moe_pretrain.ops import expert_load, route, router_scores
from moe_pretrain.ops.host_values import READ, HostValues
from moe_pretrain.ops.norms import compute_dtype


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, init_std: float, host: HostValues = READ):
        super().__init__()
        self.cfg, self.host = cfg, host
        self.gate = make_linear(dim, cfg.num_experts, init_std=init_std)
        self.gate.cast_weights = ()  # read in fp32 below: held in fp32 under any train.param_dtype
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        self.register_buffer("load", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        # Health counters since the last take_health: summed per-token routing entropy, and (int64, exact at
        # any batch size) tokens routed and rows the experts actually processed (dropless: copies - rows = 0).
        self.register_buffer("entropy_sum", torch.zeros(1), persistent=False)
        self.register_buffer("counts", torch.zeros(2, dtype=torch.int64), persistent=False)
        self.balancer = make_balancer(cfg)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (topk_idx [T, k], topk_weight [T, k] fp32+, balancing loss or None)."""
        dtype = compute_dtype(self.gate.weight.dtype)
        with torch.autocast(x_TD.device.type, enabled=False):
            logits = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
            topk_idx, topk_weight = route(logits, self.expert_bias, self.cfg.top_k, self.cfg.routed_scaling,
                                          self.host)
            # Statistics come only from forwards that train: not eval, and not the no-grad passes a
            # pipeline schedule makes to infer shapes, which would count a micro-batch twice.
            if not (self.training and torch.is_grad_enabled()):
                return topk_idx, topk_weight, None
            scores = router_scores(logits)
            if not recomputing():  # backward's second pass routes identically and must not count again
                detached = scores.detach()  # (a graph here would save tensors the recomputation does not)
                self.balancer.observe(detached, topk_idx, self.expert_bias)
                self.load += expert_load(topk_idx, self.cfg.num_experts)
                p = detached / detached.sum(dim=-1, keepdim=True)
                self.entropy_sum += -(p * p.clamp_min(1e-30).log()).sum().to(self.entropy_sum.dtype)
                self.counts[0] += x_TD.shape[0]
            return topk_idx, topk_weight, self.balancer.loss(scores, topk_idx)

    def record_processed(self, rows: int) -> None:
        """Rows this rank's experts computed (after any exchange), to account for dropped tokens."""
        if self.training and torch.is_grad_enabled() and not recomputing():
            self.counts[1] += rows

    @torch.no_grad()
    def discard_step(self) -> None:
        """Forget a skipped (non-finite) step's statistics: they must not move the bias."""
        self.balancer.discard()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Apply the balancer's update (after the optimizer step)."""
        self.expert_bias.copy_(self.balancer.next_bias(self.expert_bias))

    @torch.no_grad()
    def take_health(self) -> torch.Tensor:
        """This rank's health sums since the last call, [E + 3] float64 on the device: the load of every expert,
        then the summed routing entropy, tokens routed and rows processed (exact in float64 up to 2^53). Sums
        over ranks give the global batch's (training/moe_stats.py reduces every layer's at once). Resets them."""
        sums = torch.cat([self.load.to(torch.float64), self.entropy_sum.to(torch.float64),
                          self.counts.to(torch.float64)])
        self.load.zero_()
        self.entropy_sum.zero_()
        self.counts.zero_()
        return sums
