"""A third sequence mixer, docs/extension.md's worked example ("A sequence mixer"): plain multi-head causal
attention inside each document, with its spec. Layers with the letter A in model.layer_pattern run it once
`registered()` has put it in the tables (tests only; a mixer of the product lives in moe_pretrain/model/).

It takes its heads from model.mla (num_heads heads of v_head_dim), so it needs no config section of its own; a
mixer of the product adds one ("A config key"). It has no context-parallel strategy: the layout check refuses
parallel.cp > 1 for it (parallel/layout_rules.py, which the planner's search reads too).
"""

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from gpu_kernels.choice import Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.config.model import MIXER_LETTERS
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.mixer_spec import MixerSpec, Region, SequenceMixer
from moe_pretrain.model.mixers import MIXERS
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.ops.document_attention import document_causal_attention


class PlainAttention(SequenceMixer):
    """Causal softmax attention of each position over its document's earlier positions: q, k, v and output
    projections, no positions (NoPE, as the full-size MLA). Under tensor parallelism its column-parallel
    projections gather the sequence shards and hand it this rank's heads over the whole sequence."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, init_std: float, out_std: float):
        super().__init__()
        self.head_dim, self.scale = head_dim, head_dim**-0.5
        self.q_proj = make_linear(dim, heads * head_dim, init_std=init_std)
        self.k_proj = make_linear(dim, heads * head_dim, init_std=init_std)
        self.v_proj = make_linear(dim, heads * head_dim, init_std=init_std)
        self.o_proj = make_linear(heads * head_dim, dim, init_std=out_std)
        self.recompute_core = False

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = maybe_recompute(self.recompute_core, self._attend, q, k, v, layout)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        B, T, width = q.shape
        flat = [t.reshape(B * T, width // self.head_dim, self.head_dim) for t in (q, k, v)]
        return document_causal_attention(*flat, layout.document_bounds, self.scale).reshape(B, T, width)


class PlainAttentionSpec(MixerSpec):
    """Counts by hand (H heads of Dh, d hidden). Its saved activations were read with saved-tensor hooks on the
    layer alone and are checked so (tests/unit/test_mixer_spec.py): 5 H Dh + H + d per token (the input once for
    the three projections; q, k, v, the attention's output and the output projection's input; the log-sum-exp);
    a recomputed core gives back H Dh + H, its output and log-sum-exp, and keeps its inputs q, k, v."""

    kind = "mha"
    module = PlainAttention
    plan = (("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("o_proj", "row"))

    def build(self, d: int, m: ModelConfig, *, init_std: float, out_std: float, kernels: Kernels) -> PlainAttention:
        return PlainAttention(d, m.mla.num_heads, m.mla.v_head_dim, init_std=init_std, out_std=out_std)

    def params(self, m: ModelConfig) -> int:
        return 4 * m.hidden_size * m.mla.num_heads * m.mla.v_head_dim

    def mixing_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        keys = seq_len / 2 if keys is None else keys
        return 3 * 2 * m.mla.num_heads * 2 * m.mla.v_head_dim * keys  # q . k and p . v, forward and backward

    def rescoring_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        return self.mixing_flops(m, seq_len, keys) / 6

    def tp_widths(self, m: ModelConfig) -> int:
        return 2 * m.hidden_size  # the input gathered once for q, k, v; the output reduce-scattered

    def activations(self, m: ModelConfig, exchange: str, cp: int, tp: int) -> tuple[float, float]:
        H, Dh = m.mla.num_heads, m.mla.v_head_dim
        return 0.0, 5 * H * Dh + H + m.hidden_size

    def regions(self, m: ModelConfig, modules: frozenset[str], exchange: str, core: float) -> list[Region]:
        given_back = m.mla.num_heads * (m.mla.v_head_dim + 1)
        return [Region(rest=given_back, mixer=given_back)] if "core" in modules else []

    def muon_head_rows(self, m: ModelConfig) -> dict[str, int]:
        return dict.fromkeys(("q_proj.weight", "k_proj.weight", "v_proj.weight"), m.mla.v_head_dim)


@contextlib.contextmanager
def registered(letter: str = "A") -> Iterator[PlainAttentionSpec]:
    """PlainAttention as model.layer_pattern's `letter` while the block runs (the two tables a mixer enters)."""
    spec = PlainAttentionSpec()
    with mock.patch.dict(MIXERS, {spec.kind: spec}), mock.patch.dict(MIXER_LETTERS, {letter: spec.kind}):
        yield spec
