"""Quantile balancing's column quantiles from integer histograms, streamed over micro-batches.

The exact rule (ops.routing.quantile_balance_update) needs every router score of the step to find, per
expert j, the (q + 1)-th largest margin M_ij = s_ij + b_j - alpha_i. Here each micro-batch only adds its
margins to counts [E, B] and is then forgotten; the quantile is read from the counts after the step, as
the model class's report does (B = 1000 bins, error a few 1e-3).

The bins need no pass over the data and no collective: sigmoid scores lie in [0, 1], so with the step's
bias b (the same on every rank, fixed for the step) every margin of column j lies in
    [b_j - 1 - max(b), b_j + 1 - min(b)]
(s_ij + b_j in [b_j, 1 + b_j]; alpha_i is one of token i's biased scores, in [min(b), 1 + max(b)]).
Each column gets B equal bins over its range, width (2 + max(b) - min(b)) / B. Integer counts sum exactly
over ranks in any order, so every layout gets the bias of one process bit for bit; nothing reads a value
on the host. Inside the bin holding the quantile, values are taken as evenly spread (linear
interpolation), so the error is a fraction of a bin width.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MarginBins:
    """B equal bins per column over the range every margin of the step can take (module docstring)."""

    low: torch.Tensor
    """[E] each column's lower edge, in the margins' dtype."""
    width: torch.Tensor
    """[] one bin's width (the same for every column)."""
    count: int

    @classmethod
    def for_bias(cls, bias: torch.Tensor, count: int, dtype: torch.dtype) -> "MarginBins":
        if count < 2:
            raise ValueError(f"model.moe.qb_bins={count} must be >= 2")
        b = bias.to(dtype)
        span = 2.0 + (b.max() - b.min())
        return cls(low=b - 1.0 - b.max(), width=span / count, count=count)

    def index(self, margins: torch.Tensor) -> torch.Tensor:
        """margins [m, E] -> their bins [m, E] int64 (clamped: rounding may step past an edge)."""
        position = ((margins - self.low) / self.width).floor()
        return position.clamp_(0, self.count - 1).to(torch.int64)

    def add(self, counts: torch.Tensor, margins: torch.Tensor) -> None:
        """counts [E, B] int64 += the histogram of margins [m, E], column by column (no host read)."""
        E = margins.shape[1]
        flat = (self.index(margins) + torch.arange(E, device=margins.device) * self.count).flatten()
        counts.view(-1).index_add_(0, flat, torch.ones_like(flat))

    def kth_largest(self, counts: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        """The kth largest (1-based; kth a [] int64 tensor, <= each column's total) of every column of the
        counted values -> [E], interpolated inside its bin: the bin b where the count from the top first
        reaches kth, then (kth - count above b - 1/2) of its h values down from its upper edge, each taking
        width / h."""
        from_top = counts.flip(-1).cumsum(-1).flip(-1)  # [E, B]: values in bin >= b
        bin_ = (from_top >= kth).sum(-1, keepdim=True) - 1  # the last bin whose count from the top reaches kth
        above = torch.cat([from_top[:, 1:], from_top.new_zeros(counts.shape[0], 1)], dim=-1).gather(-1, bin_)
        inside = counts.gather(-1, bin_)
        rank_inside = (kth - above).to(self.low.dtype) - 0.5  # in (0, h): the kth's place within the bin
        upper = self.low + (bin_.squeeze(-1) + 1).to(self.low.dtype) * self.width
        return upper - (rank_inside / inside.to(self.low.dtype)).squeeze(-1) * self.width
