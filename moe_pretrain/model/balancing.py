"""Expert-load balancing strategies (MODEL.md): quantile balancing (default), aux-free, aux loss.

A balancer watches every routing of a training step (all micro-batches), then proposes the next
bias once the optimizer has stepped: statistics of one batch steer the routing of the next.
Only the aux-loss strategy adds a term to the loss; the other two move the bias and nothing else.
Statistics are those of the global batch: `stats` sums and ranks over every token of the step, on one
process (LocalStatistics) or over the data-parallel group (set by the parallel set-up), so every
rank computes the same bias.
"""

import torch

from moe_pretrain.config import MoEConfig
from moe_pretrain.ops import aux_free_update, expert_load, load_balancing_loss, quantile_balance_margins
from parallel.statistics import LocalStatistics


class Balancer:
    """Collects the step's detached scores [m, n] and choices [m, k]; subclasses turn them into a bias."""

    def __init__(self, cfg: MoEConfig):
        self.cfg = cfg
        self.stats = LocalStatistics()
        self._scores: list[torch.Tensor] = []
        self._choices: list[torch.Tensor] = []

    def observe(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> None:
        self._scores.append(scores)
        self._choices.append(topk_idx)

    def loss(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor | None:
        """A differentiable balancing loss for this forward, already weighted, or None."""
        return None

    def discard(self) -> None:
        self._scores.clear()
        self._choices.clear()

    def next_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The bias for the next step from everything observed since the last call; then forget it."""
        if not self._scores:
            return bias
        scores, choices = torch.cat(self._scores), torch.cat(self._choices)
        self._scores.clear()
        self._choices.clear()
        return self.rule(scores, choices, bias)

    def rule(self, scores: torch.Tensor, choices: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return bias


class QuantileBalancer(Balancer):
    """ops.quantile_balance_update, with m and the column quantiles taken over the global batch."""

    def rule(self, scores, choices, bias):
        k, n = self.cfg.top_k, scores.shape[1]
        margins = quantile_balance_margins(scores, bias, k)
        m = int(self.stats.total(torch.tensor(scores.shape[0], device=scores.device)))
        c = self.stats.column_kth_largest(margins, (m * k) // n + 1)
        return (bias.to(margins.dtype) - self.cfg.qb_rate * c).to(bias.dtype)


class AuxFreeBalancer(Balancer):
    """ops.aux_free_update on the global batch's expert loads."""

    def rule(self, scores, choices, bias):
        load = self.stats.total(expert_load(choices, bias.numel()))
        return aux_free_update(load, bias, self.cfg.aux_free_rate)


class AuxLossBalancer(Balancer):
    def observe(self, scores, topk_idx):
        """Nothing to keep: the loss acts through the gradient, the bias stays at 0."""

    def loss(self, scores, topk_idx):
        return self.cfg.aux_loss_coef * load_balancing_loss(scores, topk_idx)


BALANCERS = {"qb": QuantileBalancer, "aux_free": AuxFreeBalancer, "aux_loss": AuxLossBalancer}


def make_balancer(cfg: MoEConfig) -> Balancer:
    return BALANCERS[cfg.balancing](cfg)
