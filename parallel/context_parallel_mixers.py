"""The sequence mixers' parallel variants, swapped in by the activation plan (parallel/activation_plan.py).

The model's layers never ask how the sequence is split. Everything position-wise just runs on a rank's
local tokens; the two mixers that see across positions get a variant here, a subclass that overrides
only the steps that cross ranks and holds the split it crosses (parallel/context_parallel.py and
parallel/sequence.py hold the exchanges themselves):
- KDA: each local fragment is a row of its own, its convolutions take their halo from the fragment
  before, and the recurrence starts from entry states folded from every fragment's summary.
- MLA, Ulysses: the attention core is wrapped in the all-to-alls that trade heads for positions.
- MLA, latent exchange: keys and values come from the all-gathered latent, a block at a time.
- MLA under sequence parallelism (tp > 1): the shared rotary key, made by the down projection from this
  rank's sequence shard, is gathered along T (each of the three MLA classes has its sequence-parallel form).
place_mixer picks the class; the activation plan swaps each mixer's class in place (what torch's fully_shard does to
the modules it wraps), so parameters, hooks and checkpoints are untouched and a stage boundary that changes
cp or the MLA exchange swaps again.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mla import GatedMLA, rotate
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.short_conv import ShortConvolution
from moe_pretrain.ops.kda import kda_with_entry_states
from moe_pretrain.ops.latent_attention import latent_causal_attention
from parallel.context_parallel import ContextParallel, NoContextParallel
from parallel.sequence import NoSequenceParallel, SequenceParallel


class ContextPositions:
    """A context-parallel variant runs over the positions its rank holds, and holds its split."""

    context: NoContextParallel

    def _positions(self, layout: DocumentLayout) -> torch.Tensor:
        return layout.positions_held_by(self.context.local)


class ContextParallelKDA(ContextPositions, KimiDeltaAttention):
    """KDA over a rank's two fragments of every row (load-balanced: fragments r and 2 cp - 1 - r)."""

    context: ContextParallel

    def _rows(self, x_BT_: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return self.context.pieces(x_BT_)

    def _convolve(self, projected: torch.Tensor, short_conv: ShortConvolution, positions: torch.Tensor,
                  layout: DocumentLayout) -> torch.Tensor:
        cp = self.context
        return short_conv(cp.pieces(projected), positions, cp.halo(projected, short_conv.kernel_size - 1), silu=True)

    def _recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               positions: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return kda_with_entry_states(q, k, v, g, beta, positions == 0, self.context.entry_states,
                                     chunk_size=self.cfg.chunk_size, lower_bound=self.gate_floor)


class UlyssesMLA(ContextPositions, GatedMLA):
    """MLA attending over every position with H / cp of its heads (heads on a tp rank divisible by cp)."""

    context: ContextParallel

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        cp = self.context
        q, k, v = (cp.heads_to_sequence(t) for t in (q, k, v))
        return cp.sequence_to_heads(super()._core(q, k, v, layout))

    def _note_max_logits(self, maxima: torch.Tensor, layout: DocumentLayout) -> None:
        """This rank attended with head block cp.rank of its heads: the others are recorded as -inf here and
        filled by the maximum over the context group (model/qk_clip.py)."""
        cp, h = self.context, maxima.shape[0]
        placed = maxima.new_full((h * cp.size,), float("-inf"))
        placed[cp.rank * h:(cp.rank + 1) * h] = maxima
        super()._note_max_logits(placed, layout)


class LatentExchangeMLA(ContextPositions, GatedMLA):
    """MLA whose queries attend over every position's gathered latent, keys and values expanded a block at
    a time (ops.latent_attention): any cp, no rank holds the expanded K / V of the whole sequence."""

    context: NoContextParallel
    """ContextParallel, or the identity for a one-rank reference of what the exchange saves."""

    def _attend(self, q_latent: torch.Tensor, latent: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """This rank's queries [B, T / cp, H, Dn + Dr] (recomputed from their latent under mla_up) over the
        latent of every position they can see (parallel/latent_route.py), which arrives while the queries are
        made; keys and values are expanded here and again in the backward: the core saves only its output and
        log-sum-exp, so recomputing the core has nothing to add."""
        cfg = self.cfg
        mine = self._whole_sequence(latent)  # [B, T / cp, kv_lora_rank + Dr]
        route = self.context.latent_route(layout, latent.device)
        started = self.context.start_latent(mine, route)
        q = maybe_recompute(self.recompute_up, self._queries, q_latent, layout)
        B, T_local, H = q.shape[:3]
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        keys = self.context.finish_latent(mine, started, route)  # [keys seen, kv_lora_rank + Dr]
        # each key's offset in its document, for its rotation (built once per forward, shared by the layers)
        key_positions = layout.derived(
            (self.context, "latent key positions"),
            lambda: layout.sequence_positions.view(-1, T_local // 2)[route.fragments].flatten().to(q.device)) \
            if cfg.position == "rope" and Dr > 0 else None
        up = self.kv_up.weight  # this rank's heads (a column-parallel shard under tp)

        def expand(block: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            c_kv, k_rope = block.split([cfg.kv_lora_rank, Dr], dim=-1)
            k_nope, v = F.linear(self.kv_norm(c_kv), up).unflatten(-1, (H, Dn + Dv)).split([Dn, Dv], dim=-1)
            if key_positions is not None:
                k_rope = rotate(k_rope, key_positions[start:end], self.rope_theta)
            return torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, H, Dr)], dim=-1), v

        record = self._records_max_logits()
        out = latent_causal_attention(q.reshape(B * T_local, H, Dn + Dr), route.route.query_index, keys,
                                      route.route.bounds, expand, (up, self.kv_norm.weight), self.scale,
                                      max_logits=record)
        if record:
            out, maxima = out
            self.max_logits.note(maxima)
        return out.reshape(B, T_local, H, Dv)


class SequenceParallelKeys:
    """MLA's shared rotary key (and the latent exchange's latent) gathered over the sequence shards."""

    sequence: SequenceParallel

    def _whole_sequence(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return self.sequence.gather(x_BT_)


class SequenceParallelMLA(SequenceParallelKeys, GatedMLA):
    pass


class SequenceParallelUlyssesMLA(SequenceParallelKeys, UlyssesMLA):
    pass


class SequenceParallelLatentExchangeMLA(SequenceParallelKeys, LatentExchangeMLA):
    pass


MLA_CLASSES = {  # (MLA's exchange under cp, sequence parallel) -> class
    ("none", False): GatedMLA, ("ulysses", False): UlyssesMLA, ("latent", False): LatentExchangeMLA,
    ("none", True): SequenceParallelMLA, ("ulysses", True): SequenceParallelUlyssesMLA,
    ("latent", True): SequenceParallelLatentExchangeMLA,
}


def place_mixer(mixer: nn.Module, sequence: NoSequenceParallel, context: NoContextParallel) -> None:
    """Swap a sequence mixer (KDA or MLA, any of their variants) to the class the splits ask for, holding them."""
    if isinstance(mixer, KimiDeltaAttention):
        mixer.__class__ = ContextParallelKDA if context.size > 1 else KimiDeltaAttention
    else:
        if not isinstance(mixer, GatedMLA):
            raise TypeError(f"place_mixer: {type(mixer).__name__} is not a sequence mixer")
        exchange = "latent" if context.exchanges_latent else "ulysses" if context.size > 1 else "none"
        mixer.__class__ = MLA_CLASSES[exchange, sequence.size > 1]
    for name, split, used in (("context", context, context.size > 1 or context.exchanges_latent),
                              ("sequence", sequence, sequence.size > 1)):
        if used:
            setattr(mixer, name, split)
        elif name in mixer.__dict__:
            delattr(mixer, name)
