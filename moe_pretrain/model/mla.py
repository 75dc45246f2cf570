"""Gated Multi-head Latent Attention (docs/model.md, "Gated MLA").

Shape legend: B batch, T positions, D hidden, H heads, Dn nope dims, Dr rope dims, Dv value dims.
c_Q = RMSNorm(W_DQ x); q = W_UQ c_Q -> [q_nope | q_rope]; [c_KV | k_rope] = W_DKV x;
[k_nope | v] = W_UKV RMSNorm(c_KV); k = [k_nope | k_rope shared by all heads];
out = W_o [SDPA(q, k, v) * sigmoid(W_g x)], causal within each packed document
(ops.document_causal_attention, one SDPA per document, no T x T mask; on CUDA one FlexAttention call per
layer, gpu_kernels/flex_attention.py, with the block mask built once per forward).
With position = nope (full size) the rope dims are plain extra dims, never rotated.
Under tensor parallelism the up-projections return H / tp heads over the whole sequence while the
down-projections see this rank's sequence shard: the shared k_rope must be gathered along T to match. The
layer knows nothing of either split: it holds two strategies the activation plan sets
(parallel/context_parallel_mixers.py): `keys`, which makes k_rope whole along T (gathered under sequence
parallelism), and `exchange`, which attends across the context-parallel ranks (Ulysses trades heads for
positions around the core; the latent exchange gathers the latent and expands keys a block at a time:
parallel.cp_mla). The defaults, LocalAttention and WholeSequence, are a rank holding whole rows.
"""

import torch

from gpu_kernels.choice import REFERENCES, Kernels
from gpu_kernels.flex_attention import flex_document_attention
from moe_pretrain.config import MLAConfig
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.mixer_spec import SequenceMixer
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.qk_clip import MaxLogitRecord, document_max_logits
from moe_pretrain.model.recompute import maybe_recompute, recomputing
from moe_pretrain.ops.document_attention import document_causal_attention


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on the last dim of x [B, T, ..., R] (pairs (i, i + R/2)) at positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [B, T, R/2]
    while angles.dim() < x.dim():
        angles = angles.unsqueeze(-2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LocalAttention:
    """How an MLA layer attends when its rank holds whole rows: over every position, its keys and values
    expanded at once from the latent. The context-parallel exchanges (parallel/context_parallel_mixers.py) are
    the other strategies a layer may hold; the activation plan sets the one its split asks for."""

    def positions(self, layout: DocumentLayout) -> torch.Tensor:
        """[B, T] the offsets in their documents of the positions the layer attends from: every one."""
        return layout.position_in_doc

    def attend(self, mla: "GatedMLA", q_latent: torch.Tensor, latent: torch.Tensor, layout: DocumentLayout
               ) -> torch.Tensor:
        return mla.attend_expanded(q_latent, latent, layout)

    def core(self, mla: "GatedMLA", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout
             ) -> torch.Tensor:
        return mla.document_core(q, k, v, layout)

    def place_maxima(self, maxima: torch.Tensor) -> torch.Tensor:
        """The heads' maxima as QK-clip records them: this rank attended with all of its heads."""
        return maxima


class WholeSequence:
    """The shared rotary key (and the latent exchange's latent) as the layer holds it: whole along T (under
    sequence parallelism the strategy that gathers its shards: parallel/context_parallel_mixers.py)."""

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_


LOCAL_ATTENTION, WHOLE_SEQUENCE = LocalAttention(), WholeSequence()


class GatedMLA(SequenceMixer):
    def __init__(self, dim: int, cfg: MLAConfig, *, init_std: float, out_std: float, kernels: Kernels = REFERENCES):
        super().__init__()
        self.cfg = cfg
        self.attention = kernels.attention
        """flex: one FlexAttention call per layer; sdpa: one SDPA per document (Kernels.attention)."""
        self.rope_theta = cfg.rope_theta
        """RoPE base in use (position = rope); a context-extension stage may change it."""
        H = cfg.num_heads
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.scale = qk_dim**-0.5
        self.q_down = make_linear(dim, cfg.q_lora_rank, init_std=init_std)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.lora_norm_eps, kernels)
        self.q_up = make_linear(cfg.q_lora_rank, H * qk_dim, init_std=init_std)
        self.kv_down = make_linear(dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, init_std=init_std)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.lora_norm_eps, kernels)
        self.kv_up = make_linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), init_std=init_std)
        self.g_proj = make_linear(dim, H * cfg.v_head_dim, init_std=init_std)
        self.o_proj = make_linear(H * cfg.v_head_dim, dim, init_std=out_std)
        self.recompute_core = False
        """Recompute the attention core in backward (train.recompute lists core)."""
        self.recompute_up = False
        """Recompute the up-projections from the latents in backward (train.recompute lists mla_up)."""
        self.max_logits: MaxLogitRecord | None = None
        """Each head's largest logit of the step's training forwards, for QK-clip (model/qk_clip.py); None: not
        recorded (optim.qk_clip_threshold = 0)."""
        self.exchange: LocalAttention = LOCAL_ATTENTION
        """How the layer attends across the ranks that split its rows (set by the activation plan)."""
        self.keys: WholeSequence = WHOLE_SEQUENCE
        """How the shared rotary key is made whole along T (set by the activation plan)."""

    def set_recompute(self, modules: frozenset[str]) -> None:
        self.recompute_core, self.recompute_up = "core" in modules, "mla_up" in modules

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        B, T = self._positions(layout).shape  # the positions this rank attends from, whatever shard x holds
        attn = self.exchange.attend(self, self.q_down(x), self.kv_down(x), layout)
        gate = torch.sigmoid(self.g_proj(x)).reshape(*attn.shape)
        return self.o_proj((attn * gate).reshape(B, T, -1))

    def queries(self, q_latent: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The queries [B, T, H, Dn + Dr] from their latent: norm, up-projection, rotary."""
        cfg = self.cfg
        positions = self._positions(layout)
        Dn, Dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.q_up(self.q_norm(q_latent)).reshape(*positions.shape, -1, Dn + Dr)
        if cfg.position == "rope" and Dr > 0:
            q = torch.cat([q[..., :Dn], rotate(q[..., Dn:], positions, self.rope_theta)], dim=-1)
        return q

    def _positions(self, layout: DocumentLayout) -> torch.Tensor:
        """[B, T] the offsets in their documents of the positions this layer attends from (its exchange's)."""
        return self.exchange.positions(layout)

    def attend_expanded(self, q_latent: torch.Tensor, latent: torch.Tensor, layout: DocumentLayout
                          ) -> torch.Tensor:
        """Every position's keys and values expanded at once from this rank's latent [c_KV | k_rope], the
        queries from theirs; mla_up and core (train.recompute) recompute the expansion, the attention, or both
        as one region from the latents."""
        c_kv, k_rope = latent.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        k_rope = self.keys.gather(k_rope)
        if self.recompute_up and self.recompute_core:
            return maybe_recompute(True, self._expand_and_attend, q_latent, c_kv, k_rope, layout)
        # Two regions: each stops its recomputation before its up-projection where the backward does not need
        # that projection's output again (torch.utils.checkpoint stops once it has what the backward reads).
        q = maybe_recompute(self.recompute_up, self.queries, q_latent, layout)
        k, v = maybe_recompute(self.recompute_up, self._keys_values, c_kv, k_rope, layout)
        return maybe_recompute(self.recompute_core, self._core, q, k, v, layout)

    def _keys_values(self, c_kv: torch.Tensor, k_rope: torch.Tensor, layout: DocumentLayout
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, T, H, .] from the latent and the shared rotary key k_rope [B, T, Dr] (whole along T)."""
        cfg = self.cfg
        positions = self._positions(layout)
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.position == "rope" and Dr > 0:  # first: what it saves is then not behind the up-projection
            k_rope = rotate(k_rope, positions, self.rope_theta)
        k_nope, v = self.kv_up(self.kv_norm(c_kv)).reshape(*positions.shape, -1, Dn + Dv).split([Dn, Dv], dim=-1)
        return torch.cat([k_nope, k_rope.unsqueeze(2).expand(*k_nope.shape[:3], Dr)], dim=-1), v

    def _expand_and_attend(self, q_latent: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                           layout: DocumentLayout) -> torch.Tensor:
        """mla_up and core as one region, from the latents to the attention's output."""
        return self._core(self.queries(q_latent, layout), *self._keys_values(c_kv, k_rope, layout), layout)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The attention core as the exchange runs it (one region for train.recompute's core)."""
        return self.exchange.core(self, q, k, v, layout)

    def document_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout
                      ) -> torch.Tensor:
        """Causal attention within each document: [B, T, H, D] -> [B, T, H, Dv]; one FlexAttention call on the
        GPU (Kernels.attention), one SDPA per document otherwise (the reference)."""
        rows, positions, heads = q.shape[:3]
        flat = [t.reshape(rows * positions, heads, -1) for t in (q, k, v)]
        if self.attention == "flex":
            out = flex_document_attention(*flat, layout.attention_mask, self.scale)
        else:
            out = document_causal_attention(*flat, layout.document_bounds, self.scale)
        if self.records_max_logits():
            self.max_logits.note(self.exchange.place_maxima(
                document_max_logits(flat[0], flat[1], layout.document_bounds, self.scale)))
        return out.reshape(rows, positions, heads, -1)

    def records_max_logits(self) -> bool:
        """Whether this forward notes its heads' largest logits: a training forward's first pass only (a
        recomputation in backward computes the same logits; its pass would be paid again for nothing)."""
        return self.max_logits is not None and torch.is_grad_enabled() and not recomputing()
