"""The dry run's stated assumptions for the values a step reads from the device (ops/host_values.py).

Routing: every expert's share of the routed copies is given by a load vector (1 each: balanced; a hot
expert 3 means three times the mean), the same on every rank and in every MoE layer, so each rank's
all-to-all sends are the other ranks' receives; a rank's routed copies are apportioned to the experts by
largest remainders. The step's logged scalars (loss, gradient norm) are taken as 1.0: finite, so the
update runs as it would on a good step.
"""

import math

import torch


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders: the parts sum to total exactly)."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    parts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])
    for i in by_remainder[:total - sum(parts)]:
        parts[i] += 1
    return parts


class AssumedValues:
    """ops/host_values.Assumptions: routing from a load vector over the experts (None: balanced)."""

    def __init__(self, load: list[float] | None = None):
        self.load = load

    def _load(self, experts: int) -> list[float]:
        if self.load is None:
            return [1.0] * experts
        if len(self.load) != experts:
            raise ValueError(f"the expert load vector has {len(self.load)} entries for {experts} experts")
        return self.load

    def routing(self, tokens: int, k: int, experts: int, device: torch.device) -> torch.Tensor:
        """The copies of each expert (apportioned by the load) laid out column by column over [tokens, k]:
        an expert has at most `tokens` copies here (checked), so no token gets one expert twice."""
        per_expert = apportion(tokens * k, self._load(experts))
        if max(per_expert) > tokens:
            raise ValueError(f"the expert load vector gives an expert {max(per_expert)} of {tokens} tokens x {k}: "
                             "more than one copy per token (lower the hottest factor)")
        slots = torch.repeat_interleave(torch.arange(experts, device=device),
                                        torch.tensor(per_expert, device=device), output_size=tokens * k)
        return slots.reshape(k, tokens).T

    def split_sizes(self, rows: int, ep: int, rank: int, experts: int) -> tuple[list[int], list[int]]:
        """Every rank routes its `rows` copies alike (the step gives each the same tokens): rank d receives
        the copies of its experts from each rank."""
        load = self._load(experts)
        per_expert = apportion(rows, load)
        local = experts // ep
        send = [sum(per_expert[d * local:(d + 1) * local]) for d in range(ep)]
        return send, [send[rank]] * ep

    def expert_rows(self, rows: int, experts: int) -> list[int]:
        """The rows of `experts` experts that share them as the load's mean expert would (a rank's experts
        under expert parallelism are not named here: the CPU reference's loop reads these, the GPU kernel
        does not)."""
        return apportion(rows, [1.0] * experts)

    def scalars(self, count: int) -> list[float]:
        return [1.0] * count
