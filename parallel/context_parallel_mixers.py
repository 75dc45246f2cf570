"""The sequence mixers' parallel strategies, set by the activation plan (parallel/activation_plan.py).

The model's layers never ask how the sequence is split. Everything position-wise just runs on a rank's local
tokens; the two mixers that see across positions hold strategies for the steps that cross ranks
(parallel/context_parallel.py and parallel/sequence.py hold the exchanges themselves):
- KDA (its `split`): each local fragment is a row of its own, its convolutions take their halo from the
  fragment before, and the recurrence starts from entry states folded from every fragment's summary.
- MLA (its `exchange`): Ulysses wraps the attention core in the all-to-alls that trade heads for positions; the
  latent exchange expands keys and values from the all-gathered latent, a block at a time.
- MLA under sequence parallelism (tp > 1; its `keys`): the shared rotary key, made by the down projection from
  this rank's sequence shard, is gathered along T.
place_mixer sets them, by the mixer's kind (PLACEMENTS): parameters, hooks and checkpoints are untouched, and a
stage boundary that changes cp or the MLA exchange sets them again.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_pretrain.config import ConfigError
from moe_pretrain.model.kda import WHOLE_ROWS, KimiDeltaAttention, WholeRows
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mixers import spec_of_module
from moe_pretrain.model.mla import LOCAL_ATTENTION, WHOLE_SEQUENCE, GatedMLA, LocalAttention, WholeSequence, rotate
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.short_conv import ShortConvolution
from moe_pretrain.ops.kda import kda_with_entry_states
from moe_pretrain.ops.latent_attention import latent_causal_attention
from parallel.context_parallel import ContextParallel, NoContextParallel
from parallel.sequence import NoSequenceParallel, SequenceParallel


class HeldPositions:
    """A strategy over the positions its rank holds of every row, holding the split that chose them (the first
    base of each context-parallel strategy: its `positions` replace the whole-row default)."""

    def __init__(self, context: NoContextParallel):
        """context: ContextParallel, or the identity for a one-rank reference of what the latent exchange saves."""
        self.context = context

    def positions(self, layout: DocumentLayout) -> torch.Tensor:
        return layout.positions_held_by(self.context.local)


class FragmentRows(HeldPositions, WholeRows):
    """KDA over a rank's two fragments of every row (load-balanced: fragments r and 2 cp - 1 - r)."""

    context: ContextParallel

    def rows(self, x_BT_: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return self.context.pieces(x_BT_)

    def convolve(self, projected: torch.Tensor, short_conv: ShortConvolution, positions: torch.Tensor,
                 layout: DocumentLayout) -> torch.Tensor:
        cp = self.context
        return short_conv(cp.pieces(projected), positions, cp.halo(projected, short_conv.kernel_size - 1), silu=True)

    def recur(self, layer: KimiDeltaAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, positions: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return kda_with_entry_states(q, k, v, g, beta, positions == 0, self.context.entry_states,
                                     chunk_size=layer.cfg.chunk_size, lower_bound=layer.gate_floor)


class UlyssesExchange(HeldPositions, LocalAttention):
    """MLA attending over every position with H / cp of its heads (heads on a tp rank divisible by cp)."""

    context: ContextParallel

    def core(self, mla: GatedMLA, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout
             ) -> torch.Tensor:
        cp = self.context
        q, k, v = (cp.heads_to_sequence(t) for t in (q, k, v))
        return cp.sequence_to_heads(mla.document_core(q, k, v, layout))

    def place_maxima(self, maxima: torch.Tensor) -> torch.Tensor:
        """This rank attended with head block cp.rank of its heads: the others are -inf here and filled by the
        maximum over the context group (model/qk_clip.py)."""
        cp, h = self.context, maxima.shape[0]
        placed = maxima.new_full((h * cp.size,), float("-inf"))
        placed[cp.rank * h:(cp.rank + 1) * h] = maxima
        return placed


class LatentExchange(HeldPositions, LocalAttention):
    """MLA whose queries attend over every position's gathered latent, keys and values expanded a block at a
    time (ops.latent_attention): any cp, no rank holds the expanded K / V of the whole sequence."""

    def attend(self, mla: GatedMLA, q_latent: torch.Tensor, latent: torch.Tensor, layout: DocumentLayout
               ) -> torch.Tensor:
        """This rank's queries [B, T / cp, H, Dn + Dr] (recomputed from their latent under mla_up) over the
        latent of every position they can see (parallel/latent_route.py), which arrives while the queries are
        made; keys and values are expanded here and again in the backward: the core saves only its output and
        log-sum-exp, so recomputing the core has nothing to add."""
        cfg = mla.cfg
        mine = mla.keys.gather(latent)  # [B, T / cp, kv_lora_rank + Dr]
        route = self.context.latent_route(layout, latent.device)
        started = self.context.start_latent(mine, route)
        q = maybe_recompute(mla.recompute_up, mla.queries, q_latent, layout)
        B, T_local, H = q.shape[:3]
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        keys = self.context.finish_latent(mine, started, route)  # [keys seen, kv_lora_rank + Dr]
        # each key's offset in its document, for its rotation (built once per forward, shared by the layers)
        key_positions = layout.derived(
            (self.context, "latent key positions"),
            lambda: layout.sequence_positions.view(-1, T_local // 2)[route.fragments].flatten().to(q.device)) \
            if cfg.position == "rope" and Dr > 0 else None
        up = mla.kv_up.weight  # this rank's heads (a column-parallel shard under tp)

        def expand(block: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            c_kv, k_rope = block.split([cfg.kv_lora_rank, Dr], dim=-1)
            k_nope, v = F.linear(mla.kv_norm(c_kv), up).unflatten(-1, (H, Dn + Dv)).split([Dn, Dv], dim=-1)
            if key_positions is not None:
                k_rope = rotate(k_rope, key_positions[start:end], mla.rope_theta)
            return torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, H, Dr)], dim=-1), v

        record = mla.records_max_logits()
        out = latent_causal_attention(q.reshape(B * T_local, H, Dn + Dr), route.route.query_index, keys,
                                      route.route.bounds, expand, (up, mla.kv_norm.weight), mla.scale,
                                      max_logits=record)
        if record:
            out, maxima = out
            mla.max_logits.note(maxima)
        return out.reshape(B, T_local, H, Dv)


class SequenceGather(WholeSequence):
    """MLA's shared rotary key (and the latent exchange's latent) gathered over the sequence shards."""

    def __init__(self, sequence: SequenceParallel):
        self.sequence = sequence

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return self.sequence.gather(x_BT_)


def _place_kda(mixer: KimiDeltaAttention, sequence: NoSequenceParallel, context: NoContextParallel) -> None:
    mixer.split = FragmentRows(context) if context.size > 1 else WHOLE_ROWS


def _place_mla(mixer: GatedMLA, sequence: NoSequenceParallel, context: NoContextParallel) -> None:
    mixer.exchange = LatentExchange(context) if context.exchanges_latent \
        else UlyssesExchange(context) if context.size > 1 else LOCAL_ATTENTION
    mixer.keys = SequenceGather(sequence) if sequence.size > 1 else WHOLE_SEQUENCE


PLACEMENTS = {"kda": _place_kda, "mla": _place_mla}
"""By mixer kind (model/mixers.MIXERS): how a mixer's cross-rank strategies follow the splits. A mixer without
an entry holds none: it sees its rows whole (its projections gather the sequence-parallel shards) and runs only
where no context parallelism splits them."""


def place_mixer(mixer: nn.Module, sequence: NoSequenceParallel, context: NoContextParallel) -> None:
    """Set a sequence mixer's strategies to what the splits ask for."""
    spec = spec_of_module(mixer)
    if spec is None:
        raise TypeError(f"place_mixer: {type(mixer).__name__} is not a sequence mixer (model/mixers.MIXERS)")
    if spec.kind in PLACEMENTS:
        PLACEMENTS[spec.kind](mixer, sequence, context)
    elif context.size > 1:
        raise ConfigError(f"parallel.cp={context.size}: the {spec.kind} mixer has no context-parallel strategy "
                          "(parallel/context_parallel_mixers.PLACEMENTS); set parallel.cp=1 or use another mixer")
