"""Where documents start and end in a packed batch, computed once per forward and shared by all layers.

Shape legend: B sequences, T positions. Packed sequences hold several documents; KDA resets its
state, the short convolutions stop, and MLA masks attention at every document boundary.
Every field describes the whole sequence. A context-parallel rank holds only some positions of it: its mixers
(parallel/context_parallel_mixers.py) ask for those positions' offsets with positions_held_by, and MLA still
attends over the whole sequence that cu_seqlens and document_bounds describe.
"""

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from gpu_kernels.flex_attention import document_block_mask
from moe_pretrain.ops.host_values import READ, HostValues


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of rows doc_ids [B, T] flattened: where each document starts (every row starts one), then
    B x T. The plan reads the same from a stage's data (planning/documents.py)."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat_starts = torch.nonzero(starts.reshape(-1)).squeeze(-1)
    return torch.cat([flat_starts, flat_starts.new_tensor([B * T])])


@dataclass(frozen=True)
class DocumentLayout:
    position_in_doc: torch.Tensor
    """[B, T] offset of each position from its document's start (RoPE positions, conv validity)."""
    cu_seqlens: torch.Tensor
    """[N + 1] int64 offsets of the N documents in the flattened [1, B*T] sequence (fla convention)."""
    host: HostValues = field(default=READ, compare=False, repr=False)
    """How values the data decides are computed (real in a dry run as well: ops/host_values.py)."""
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, host: HostValues = READ) -> "DocumentLayout":
        """doc_ids [B, T]: the document number of each position (non-decreasing along T)."""
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [B, T], got {tuple(doc_ids.shape)}")
        B, T = doc_ids.shape
        with host.data_values():  # the data decides these: real values in a dry run as well
            cu_seqlens = document_starts(doc_ids)
            flat_starts = cu_seqlens[:-1]
            positions = torch.arange(B * T, device=doc_ids.device)
            start_of = flat_starts[torch.searchsorted(flat_starts, positions, right=True) - 1]
            return cls((positions - start_of).reshape(B, T), cu_seqlens, host)

    @classmethod
    def single_documents(cls, batch: int, seq_len: int, device: torch.device, host: HostValues = READ
                         ) -> "DocumentLayout":
        """Every row one document (no packing)."""
        return cls.from_doc_ids(torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq_len), host)

    def positions_held_by(self, keep: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """position_in_doc of the positions `keep` selects from a [B, T] tensor (a context-parallel rank's:
        its `local`), computed once per forward for every layer that asks with the same `keep`."""
        return self.derived(keep, lambda: keep(self.position_in_doc))

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """make(), a value the data decides (real in a dry run as well), computed once per forward under `key`
        and shared by every layer that asks for it: a rank's positions, its latent exchange's route."""
        if key not in self._derived:
            with self.host.data_values():
                self._derived[key] = make()
        return self._derived[key]

    @functools.cached_property
    def document_bounds(self) -> list[int]:
        """cu_seqlens as host integers, read once per forward (MLA's per-document loop needs them on the
        host; every MLA layer shares this one device-to-host copy)."""
        return self.cu_seqlens.tolist()

    @functools.cached_property
    def attention_mask(self) -> BlockMask:
        """FlexAttention's block mask of the whole flattened sequence (causal, within documents), built on the
        device once per forward and shared by every MLA layer (gpu_kernels/flex_attention.py)."""
        return document_block_mask(self.cu_seqlens, self.document_bounds[-1])

    @functools.cached_property
    def sequence_positions(self) -> torch.Tensor:
        """[B * T] every position's offset in its document over the flattened whole sequence (every cp
        rank's positions, not only this one's), built once per forward: the latent exchange rotates each
        gathered key by it in every MLA layer."""
        starts = self.cu_seqlens
        index = torch.arange(self.document_bounds[-1], device=starts.device)  # the bounds MLA reads anyway
        return index - starts[torch.searchsorted(starts, index, right=True) - 1]
