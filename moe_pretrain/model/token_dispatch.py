"""Expert token dispatch: the interface and its single-process reference (STYLE.md rule 3).

Shape legend: T tokens, k experts per token, L latent width, E experts (E_local on this rank).
exchange() runs each token through its experts: dispatch() groups the routed copies of tokens by expert,
the experts compute, combine() undoes the grouping and applies the routing weights. The expert-parallel
dispatchers subclass this and move the grouped rows between ranks on the way; the local one is the
reference they are tested against.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_pretrain.ops.permute import permute, unpermute
from moe_pretrain.ops.routing import expert_load

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""experts(rows grouped by local expert [R, L], rows per local expert [E_local]) -> their outputs [R, L]."""


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (a permutation of its indices)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


@dataclass(frozen=True)
class DispatchMetadata:
    """What combine() needs to undo dispatch(): where each routed copy went, and its weight."""

    positions: torch.Tensor
    """[T, k] expert-order row of copy j of token t."""
    weights: torch.Tensor
    """[T, k] routing weight of each copy (the router's dtype)."""


class LocalTokenDispatcher:
    """All experts live on this process: dispatch is a stable sort by expert id."""

    permutes = True
    """Whether exchange() moves its rows through permute / unpermute (the fast-path report reads it: a dispatcher
    that gathers its rows by index runs no permute kernel, whatever Kernels.triton says)."""

    def __init__(self, num_experts: int, *, fused: bool = False):
        self.num_experts = num_experts
        self.fused = fused
        """permute / unpermute through our Triton kernels (Kernels.triton)."""
        self.num_local_experts = num_experts
        self.first_local_expert = 0
        self.rows_received = 0
        """Rows this rank's experts have received since it was built (host integers the dispatch knows
        anyway; the straggler check tells expert load from slow hardware with them)."""

    def dispatch(
        self, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """-> (rows grouped by local expert [T*k, L], tokens per local expert [E_local], metadata)."""
        num_tokens, k = topk_idx.shape
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        positions = inverse_order(order).reshape(num_tokens, k)
        counts = expert_load(flat_expert, self.num_experts)
        return permute(x_TL, order // k, positions, fused=self.fused), counts, DispatchMetadata(positions, topk_weight)

    def combine(self, y_grouped: torch.Tensor, meta: DispatchMetadata) -> torch.Tensor:
        """Weighted sum of each token's expert outputs -> [T, L] in y's dtype."""
        return unpermute(y_grouped, meta.positions, meta.weights, fused=self.fused)

    def exchange(self, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        """Each token through its k experts and back, weighted and summed -> [T, L] (the expert-parallel
        dispatchers move the rows between ranks on the way)."""
        grouped, counts, meta = self.dispatch(x_TL, topk_idx, topk_weight)
        self.rows_received += topk_idx.numel()
        return self.combine(experts(grouped, counts), meta)
