"""The dry run's stated assumptions for the values a step reads from the device (ops/host_values.py).

Routing: every expert's share of the routed copies is given by a load vector (1 each: balanced; a hot
expert 3 means three times the mean), the same on every rank and in every MoE layer, so each rank's
all-to-all sends are the other ranks' receives; a rank's routed copies are apportioned to the experts by
largest remainders. Which experts share a token is spread as uniformly random routing spreads them: the
experts are laid out in a fixed shuffled order (seed 0) and a token's k copies fall 1 / k of the way apart
in it, so a token reaches as many distinct nodes as random routing's expectation, within a few percent
(the node dispatch sends a row per node reached: parallel/node_dispatch.py). The step's logged scalars
(loss, gradient norm) are taken as 1.0: finite, so the update runs as it would on a good step.
"""

import math
import random

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
        self._reaching: dict[tuple[int, int, int, int], list[int]] = {}

    def _load(self, experts: int) -> list[float]:
        if self.load is None:
            return [1.0] * experts
        if len(self.load) != experts:
            raise ValueError(f"the expert load vector has {len(self.load)} entries for {experts} experts")
        return self.load

    def _order(self, experts: int) -> list[int]:
        """The experts in the routing's layout order: shuffled, so that a token's experts are spread over the
        ranks and nodes as random routing spreads them."""
        order = list(range(experts))
        random.Random(0).shuffle(order)
        return order

    def per_expert(self, rows: int, experts: int) -> list[int]:
        """Copies of each expert (by id) among `rows` routed copies: the load apportioned in layout order."""
        order = self._order(experts)
        load = self._load(experts)
        counts = [0] * experts
        for expert, n in zip(order, apportion(rows, [load[e] for e in order]), strict=True):
            counts[expert] = n
        return counts

    def routing(self, tokens: int, k: int, experts: int, device: torch.device) -> torch.Tensor:
        """The copies of each expert laid out in layout order column by column over [tokens, k]: an expert has
        at most `tokens` copies here (checked), so no token gets one expert twice."""
        order = self._order(experts)
        per_expert = self.per_expert(tokens * k, experts)
        if max(per_expert) > tokens:
            raise ValueError(f"the expert load vector gives an expert {max(per_expert)} of {tokens} tokens x {k}: "
                             "more than one copy per token (lower the hottest factor)")
        slots = torch.repeat_interleave(torch.tensor(order, device=device),
                                        torch.tensor([per_expert[e] for e in order], device=device),
                                        output_size=tokens * k)
        return slots.reshape(k, tokens).T

    def split_sizes(self, rows: int, ep: int, rank: int, experts: int) -> tuple[list[int], list[int]]:
        """Every rank routes its `rows` copies alike (the step gives each the same tokens): rank d receives
        the copies of its experts from each rank."""
        per_expert = self.per_expert(rows, experts)
        local = experts // ep
        send = [sum(per_expert[d * local:(d + 1) * local]) for d in range(ep)]
        return send, [send[rank]] * ep

    def node_split_sizes(self, tokens: int, k: int, experts: int, nodes: int, ranks_per_node: int, rank: int
                         ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """The node dispatch's exchanges when every rank routes its `tokens` alike: a rank sends each node the
        tokens reaching it and receives as many from each node; the forwarding rank sends each rank of its
        node that rank's copies of every node's tokens, and receives as many from each."""
        reached = self._tokens_reaching(tokens, k, experts, nodes)
        node = rank // ranks_per_node
        copies = self.split_sizes(tokens * k, nodes * ranks_per_node, rank, experts)[0]
        node_copies = copies[node * ranks_per_node:(node + 1) * ranks_per_node]
        return ((reached, [reached[node]] * nodes),
                ([nodes * c for c in node_copies], [nodes * copies[rank]] * ranks_per_node))

    def _tokens_reaching(self, tokens: int, k: int, experts: int, nodes: int) -> list[int]:
        """Tokens with a copy on each node, from routing()'s layout, in Python: no torch op here, so the dry
        run's meters see only the step's own."""
        key = (tokens, k, experts, nodes)
        if key not in self._reaching:
            order, per_expert = self._order(experts), self.per_expert(tokens * k, experts)
            slots = [e for e in order for _ in range(per_expert[e])]
            per_node = experts // nodes
            token_nodes = [{slots[j * tokens + t] // per_node for j in range(k)} for t in range(tokens)]
            self._reaching[key] = [sum(n in reached for reached in token_nodes) for n in range(nodes)]
        return self._reaching[key]

    def expert_rows(self, rows: int, experts: int) -> list[int]:
        """The rows of `experts` experts that share them as the load's mean expert would (a rank's experts
        under expert parallelism are not named here: the CPU reference's loop reads these, the GPU kernel
        does not)."""
        return apportion(rows, [1.0] * experts)

    def scalars(self, count: int) -> list[float]:
        return [1.0] * count
