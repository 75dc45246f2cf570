"""Expert token dispatch: the interface and its single-process reference (STYLE.md rule 3).

Shape legend: T tokens, k experts per token, L latent width, E experts (E_local on this rank).
dispatch() groups the routed copies of tokens by expert; combine() undoes the grouping and applies
the routing weights. The expert-parallel all-to-all dispatcher subclasses this and moves the grouped
rows between ranks in between; the local one is the reference it is tested against.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchMetadata:
    """What combine() needs to undo dispatch(): the sort order and the routing of each copy."""

    order: torch.Tensor
    """[T * k] positions of the flattened (token, slot) copies in expert-sorted order."""
    token_index: torch.Tensor
    """[T * k] the token each sorted copy came from."""
    weights: torch.Tensor
    """[T * k] routing weight of each sorted copy."""
    num_tokens: int


class LocalTokenDispatcher:
    """All experts live on this process: dispatch is a stable sort by expert id."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.first_local_expert = 0

    def dispatch(
        self, x_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """-> (rows grouped by local expert [T*k, L], tokens per local expert [E_local], metadata)."""
        num_tokens, k = topk_idx.shape
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_index = order // k
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        meta = DispatchMetadata(order, token_index, topk_weight.reshape(-1)[order], num_tokens)
        return x_TL[token_index], counts, meta

    def combine(self, y_grouped: torch.Tensor, meta: DispatchMetadata) -> torch.Tensor:
        """Weighted sum of each token's expert outputs -> [T, L] in y's dtype."""
        weighted = y_grouped * meta.weights.to(y_grouped.dtype).unsqueeze(-1)
        out = y_grouped.new_zeros(meta.num_tokens, y_grouped.shape[-1])
        return out.index_add(0, meta.token_index, weighted)
