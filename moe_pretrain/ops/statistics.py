"""Statistics over the batch the balancers need, as one process sees them: the interface the routers call and
its single-process reference (parallel/statistics.py's GroupStatistics takes them over a process group)."""

import torch


class LocalStatistics:
    """Everything is already here: sums are identities, quantiles are sorts."""

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def column_kth_largest(self, values: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        """The kth largest (kth: a 0-d integer tensor, 1-based) of each column of values [m, n] -> [n]."""
        return values.sort(dim=0, descending=True).values[kth - 1]
