"""Context parallelism as a style of the parallel set-up: the sequence mixers' cp variants, swapped in.

The model's layers never ask how the sequence is split. Everything position-wise just runs on a rank's
local tokens; the two mixers that see across positions get a variant here, a subclass that overrides
only the steps that cross ranks (parallel/context_parallel.py holds the exchanges themselves):
- KDA: each local fragment is a row of its own, its convolutions take their halo from the fragment
  before, and the recurrence starts from entry states folded from every fragment's summary.
- MLA, Ulysses: the attention core is wrapped in the all-to-alls that trade heads for positions.
- MLA, latent exchange: keys and values come from the all-gathered latent, a block at a time.
apply_context_parallel swaps each mixer's class in place (what torch's fully_shard does to the modules
it wraps), so parameters, hooks and checkpoints are untouched and a stage boundary that changes cp or
the MLA exchange swaps again. The variants read the split from the layout (DocumentLayout.context),
which the model builds from its own `context`, set here too: one source for both.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mla import GatedMLA, rotate
from moe_pretrain.model.short_conv import ShortConvolution
from moe_pretrain.ops.kda import kda_with_entry_states
from moe_pretrain.ops.latent_attention import latent_causal_attention
from parallel.context_parallel import NoContextParallel


class ContextParallelKDA(KimiDeltaAttention):
    """KDA over a rank's two fragments of every row (load-balanced: fragments r and 2 cp - 1 - r)."""

    def _rows(self, x_BT_: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return layout.context.pieces(x_BT_)

    def _convolve(self, projected: torch.Tensor, short_conv: ShortConvolution, positions: torch.Tensor,
                  layout: DocumentLayout) -> torch.Tensor:
        cp = layout.context
        return short_conv(cp.pieces(projected), positions, cp.halo(projected, short_conv.kernel_size - 1))

    def _recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               positions: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return kda_with_entry_states(q, k, v, g, beta, positions == 0, layout.context.entry_states,
                                     chunk_size=self.cfg.chunk_size, lower_bound=self.gate_floor)


class UlyssesMLA(GatedMLA):
    """MLA attending over every position with H / cp of its heads (heads on a tp rank divisible by cp)."""

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        cp = layout.context
        q, k, v = (cp.heads_to_sequence(t) for t in (q, k, v))
        return cp.sequence_to_heads(super()._core(q, k, v, layout))

    def _note_max_logits(self, maxima: torch.Tensor, layout: DocumentLayout) -> None:
        """This rank attended with head block cp.rank of its heads: the others are recorded as -inf here and
        filled by the maximum over the context group (model/qk_clip.py)."""
        cp, h = layout.context, maxima.shape[0]
        placed = maxima.new_full((h * cp.size,), float("-inf"))
        placed[cp.rank * h:(cp.rank + 1) * h] = maxima
        super()._note_max_logits(placed, layout)


class LatentExchangeMLA(GatedMLA):
    """MLA whose queries attend over every position's gathered latent, keys and values expanded a block at
    a time (ops.latent_attention): any cp, no rank holds the expanded K / V of the whole sequence."""

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """This rank's queries [B, T / cp, H, Dn + Dr] over every position's latent, expanded here and
        again in the backward: the core saves only its output and log-sum-exp, so selective
        recomputation has nothing to add."""
        cfg = self.cfg
        B, T_local, H = q.shape[:3]
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        every = layout.context.gather_sequence(layout.sequence.gather(latent))  # [B, T, kv_lora_rank + Dr]
        T = every.shape[1]
        # each key's offset in its document, for its rotation (built once per forward, shared by the layers)
        key_positions = layout.sequence_positions.to(q.device) if cfg.position == "rope" and Dr > 0 else None
        up = self.kv_up.weight  # this rank's heads (a column-parallel shard under tp)

        def expand(block: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            c_kv, k_rope = block.split([cfg.kv_lora_rank, Dr], dim=-1)
            k_nope, v = F.linear(self.kv_norm(c_kv), up).unflatten(-1, (H, Dn + Dv)).split([Dn, Dv], dim=-1)
            if key_positions is not None:
                k_rope = rotate(k_rope, key_positions[start:end], self.rope_theta)
            return torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, H, Dr)], dim=-1), v

        record = self.max_logits is not None and torch.is_grad_enabled()
        out = latent_causal_attention(q.reshape(B * T_local, H, Dn + Dr), layout.context.global_index(B, T),
                                      every.reshape(B * T, -1), layout.document_bounds, expand,
                                      (up, self.kv_norm.weight), self.scale, max_logits=record)
        if record:
            out, maxima = out
            self.max_logits.note(maxima)
        return out.reshape(B, T_local, H, Dv)


def _mixer_class(module: nn.Module, context: NoContextParallel) -> type | None:
    """The class a sequence mixer takes under `context` (None: not a sequence mixer)."""
    if isinstance(module, KimiDeltaAttention):
        return ContextParallelKDA if context.size > 1 else KimiDeltaAttention
    if isinstance(module, GatedMLA):
        if context.exchanges_latent:  # also on one rank (a test's reference for what the exchange saves)
            return LatentExchangeMLA
        return UlyssesMLA if context.size > 1 else GatedMLA
    return None


def apply_context_parallel(model: nn.Module, context: NoContextParallel) -> None:
    """Split every sequence the model (or a single mixer) sees as `context` says: each sequence mixer takes
    its variant's class (the plain layer's without cp) and a model with a `context` of its own takes this
    one, from which it builds every forward's layout."""
    for module in model.modules():
        cls = _mixer_class(module, context)
        if cls is not None:
            module.__class__ = cls
    if isinstance(getattr(model, "context", None), NoContextParallel):
        model.context = context
