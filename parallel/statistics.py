"""Statistics over the global batch for the balancers, without gathering per-token data.

LocalStatistics (moe_pretrain/ops/statistics.py) is the single-process reference. GroupStatistics reduces over
a process group (the data-parallel group, which holds every token of the global batch). Its per-column k-th
largest value is found by bisection on the order-preserving integer image of the floats: each of 64 (or 32)
rounds, the key's width, all-reduces one count per column, and the result is exactly the value a sort of all
tokens would give, because every step compares the same floats the sort would. The rounds are a fixed count
and k may be a device tensor, so the host reads nothing: no sync per round on a GPU, and a dry run (fake
tensors, no values) issues the same collectives a run does.
"""

import torch
import torch.distributed as dist

from moe_pretrain.ops.statistics import LocalStatistics
from parallel.collectives import all_reduce_max, all_reduce_sum

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32}


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """An integer tensor with the same order as the float tensor x (IEEE bits, negatives flipped)."""
    bits = x.contiguous().view(_INT_VIEW[x.dtype])
    magnitude = bits & torch.iinfo(bits.dtype).max
    return torch.where(bits >= 0, bits, -magnitude - 1)


def keys_to_floats(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    magnitude = torch.where(keys >= 0, keys, -(keys + 1))
    bits = torch.where(keys >= 0, keys, magnitude | torch.iinfo(keys.dtype).min)
    return bits.view(dtype)


class GroupStatistics(LocalStatistics):
    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.group)

    def column_kth_largest(self, values: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        """Exact kth largest of each column over the rows of every rank: the largest key c with
        count(key >= c) >= kth, by bisection on [global min, global max]. count(key >= lo) >= kth holds
        throughout, so a settled column (lo == hi) stays put, and the key's width in rounds settles every
        column: each round leaves at most half of the interval, rounded up."""
        keys = ordered_keys(values)
        n = values.shape[1]
        extreme = torch.iinfo(keys.dtype)
        local_hi = (keys.max(dim=0).values if keys.shape[0]
                    else torch.full((n,), extreme.min, dtype=keys.dtype, device=keys.device))
        local_lo = (keys.min(dim=0).values if keys.shape[0]
                    else torch.full((n,), extreme.max, dtype=keys.dtype, device=keys.device))
        hi = all_reduce_max(local_hi, self.group)
        lo = -all_reduce_max(-local_lo, self.group)  # keys never reach the type's minimum, so -x is safe
        for _ in range(extreme.bits):
            # Upper midpoint without overflow: floor((lo + hi) / 2) + ((lo ^ hi) & 1).
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)
            counts = all_reduce_sum((keys >= mid).sum(dim=0), self.group)
            enough = counts >= kth
            lo = torch.where(enough, mid, lo)
            hi = torch.where(enough, hi, mid - 1)
        return keys_to_floats(lo, values.dtype)
