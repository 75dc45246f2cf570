"""Expert-load balancing strategies (docs/model.md): quantile balancing (default), aux-free, aux loss.

A balancer watches every routing of a training step (all micro-batches), then proposes the next
bias once the optimizer has stepped: statistics of one batch steer the routing of the next.
Quantile balancing reads its column quantiles from margin histograms by default (model.moe.qb_quantile=
histogram: integer counts, a few MB per layer, one collective per pipeline stage per step, no host read);
qb_quantile=exact keeps every score of the step and finds the exact quantile (the reference).
Only the aux-loss strategy adds a term to the loss; the other two move the bias and nothing else.
Statistics are those of the global batch: `stats` sums and ranks over every token of the step, on one
process (LocalStatistics) or over the data-parallel group (set by the parallel set-up), so every
rank computes the same bias.
"""

import torch

from moe_pretrain.config import MoEConfig
from moe_pretrain.ops import aux_free_update, expert_load, load_balancing_loss, quantile_balance_margins
from moe_pretrain.ops.margin_histogram import MarginBins
from moe_pretrain.ops.statistics import LocalStatistics


class Balancer:
    """What the router asks of a balancing strategy; the base observes nothing and keeps the bias."""

    def __init__(self, cfg: MoEConfig):
        self.cfg = cfg
        self.stats = LocalStatistics()

    def observe(self, scores: torch.Tensor, topk_idx: torch.Tensor, bias: torch.Tensor) -> None:
        """One forward's detached scores [m, n] and choices [m, k] under the step's bias [n]."""

    def loss(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor | None:
        """A differentiable balancing loss for this forward, already weighted, or None."""
        return None

    def discard(self) -> None:
        """Forget the step (a skipped step)."""

    def next_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The bias for the next step from everything observed since the last call; then forget it."""
        return bias

    def unreduced_counts(self) -> torch.Tensor | None:
        """This rank's step statistics still to be summed over the balancing group, where the strategy lets
        reduce_pending sum them together with other layers' (one collective for all); None otherwise."""
        return None

    def take_reduced(self, counts: torch.Tensor) -> None:
        """The group's sum of unreduced_counts(), from reduce_pending."""
        raise NotImplementedError(f"{type(self).__name__} has no counts to reduce")


class KeptScoresBalancer(Balancer):
    """Keeps the step's detached scores [m, n] and choices [m, k]; subclasses turn them into a bias (rule)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        self._scores: list[torch.Tensor] = []
        self._choices: list[torch.Tensor] = []

    def observe(self, scores, topk_idx, bias):
        self._scores.append(scores)
        self._choices.append(topk_idx)

    def discard(self):
        self._scores.clear()
        self._choices.clear()

    def next_bias(self, bias):
        if not self._scores:
            return bias
        scores, choices = torch.cat(self._scores), torch.cat(self._choices)
        self.discard()
        return self.rule(scores, choices, bias)

    def rule(self, scores: torch.Tensor, choices: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class QuantileBalancer(KeptScoresBalancer):
    """ops.quantile_balance_update, with m and the column quantiles taken over the global batch: exact, from
    every score of the step (kept until the step ends; bisection over ranks, parallel/statistics.py)."""

    def rule(self, scores, choices, bias):
        k, n = self.cfg.top_k, scores.shape[1]
        margins = quantile_balance_margins(scores, bias, k)
        m = self.stats.total(torch.tensor(scores.shape[0], device=scores.device))
        c = self.stats.column_kth_largest(margins, (m * k) // n + 1)
        return (bias.to(margins.dtype) - self.cfg.qb_rate * c).to(bias.dtype)


class HistogramQuantileBalancer(Balancer):
    """Quantile balancing with the column quantiles read from histograms of the margins (ops.margin_histogram):
    each forward bins its margins into counts [n, B] and keeps nothing else; after the step the counts are
    summed over the balancing group (every layer of a stage in one collective: reduce_pending) and the bias
    follows from them on the device."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        self.counts: torch.Tensor | None = None
        """[n, B] int64, this step's counts: this rank's, or the group's once `reduced`."""
        self.bins: MarginBins | None = None
        self.reduced = False

    def observe(self, scores, topk_idx, bias):
        margins = quantile_balance_margins(scores, bias, self.cfg.top_k)
        if self.counts is None:  # the step's first forward: the bias, hence the bins, hold until the step ends
            self.bins = MarginBins.for_bias(bias, self.cfg.qb_bins, margins.dtype)
            self.counts = torch.zeros(scores.shape[1], self.cfg.qb_bins, dtype=torch.int64, device=scores.device)
        self.bins.add(self.counts, margins)

    def discard(self):
        self.counts, self.bins, self.reduced = None, None, False

    def unreduced_counts(self):
        return None if self.counts is None or self.reduced else self.counts

    def take_reduced(self, counts):
        self.counts, self.reduced = counts, True

    def next_bias(self, bias):
        if self.counts is None:
            return bias
        counts, bins = (self.counts if self.reduced else self.stats.total(self.counts)), self.bins
        self.discard()
        m = counts[0].sum()  # every token of the global batch falls in one bin of each column
        c = bins.kth_largest(counts, (m * self.cfg.top_k) // counts.shape[0] + 1)
        return (bias.to(c.dtype) - self.cfg.qb_rate * c).to(bias.dtype)


def reduce_pending(balancers: list[Balancer]) -> None:
    """Sum the step's statistics of these balancers that let it (histogram quantile balancing: its counts) over
    their group in one collective (a pipeline stage's balancers share one group: parallel/parallelize.py), so
    next_bias needs none."""
    pending = [(b, counts) for b in balancers if (counts := b.unreduced_counts()) is not None]
    if not pending:
        return
    totals = pending[0][0].stats.total(torch.stack([counts for _, counts in pending]))
    for (balancer, _), counts in zip(pending, totals.unbind(0), strict=True):
        balancer.take_reduced(counts)


class AuxFreeBalancer(KeptScoresBalancer):
    """ops.aux_free_update on the global batch's expert loads."""

    def rule(self, scores, choices, bias):
        load = self.stats.total(expert_load(choices, bias.numel()))
        return aux_free_update(load, bias, self.cfg.aux_free_rate)


class AuxLossBalancer(Balancer):
    """Observes nothing: the loss acts through the gradient, the bias stays at 0."""

    def loss(self, scores, topk_idx):
        return self.cfg.aux_loss_coef * load_balancing_loss(scores, topk_idx)


BALANCERS = {"qb": QuantileBalancer, "aux_free": AuxFreeBalancer, "aux_loss": AuxLossBalancer}


def make_balancer(cfg: MoEConfig) -> Balancer:
    if cfg.balancing == "qb" and cfg.qb_quantile == "histogram":
        return HistogramQuantileBalancer(cfg)
    return BALANCERS[cfg.balancing](cfg)
