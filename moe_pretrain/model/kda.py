"""Kimi Delta Attention layer (docs/model.md, "KDA"), over ops.kda.

Shape legend: B batch, T positions, D hidden, H heads, K = V = head_dim.
q, k = L2Norm(SiLU(ShortConv(W x))), v = SiLU(ShortConv(W_v x)); channel-wise log decay g from the
low-rank f = W_fb W_fa x; beta = sigmoid(W_b x); y = W_o [sigmoid(W_g x) * RMSNorm_head(o)].
The packed batch is flattened to [1, B*T] so documents (and rows) are cu_seqlens segments. The layer knows
nothing of context parallelism: it holds a strategy for the steps that see across positions (its `split`:
positions, rows, convolutions, recurrence), whole rows by default; the activation plan sets the
context-parallel one (parallel/context_parallel_mixers.py).
Under tensor parallelism the layer holds H / tp heads (parallel/plan.py) and its column projections
return the whole sequence, so head counts and T are read from the tensors, not the config.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import KDAConfig
from moe_pretrain.model.init import Constant, InverseSoftplusLogUniform, LogUniform
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.mixer_spec import SequenceMixer
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.short_conv import ShortConvolution
from moe_pretrain.ops import kda, l2_norm, rms_norm
from moe_pretrain.ops.norms import compute_dtype

DT_RANGE = (1e-3, 1e-1)
"""Initial per-channel step sizes dt, log-uniform in this range (fla's dt_min, dt_max)."""


def dt_bias_init() -> InverseSoftplusLogUniform:
    """softplus^-1(dt) with log dt ~ U(log 1e-3, log 1e-1) per channel: at f = 0 the gate's argument is dt.
    With the bounded gate and A_log = 0 the first-step decay is exp(-5 (1 - e^-dt)), spread over
    (0.62, 0.995) with median 0.95: KDA layers start with memories from a few to a few hundred tokens."""
    return InverseSoftplusLogUniform(*DT_RANGE)


def a_log_init(gate: str) -> Constant | LogUniform:
    """0 for the bounded gate (the rate is then 1 and dt_bias alone sets each channel's decay); log U(1, 16)
    for fla's softplus gate. (log U(1, 16) under the bounded gate would start every channel near decay 0.08.)"""
    return Constant(0.0) if gate == "lower_bound" else LogUniform(1.0, 16.0, log=True)


class WholeRows:
    """KDA over rows its rank holds whole: the batch's own rows, convolutions that start at each row, the
    recurrence over the packed documents."""

    def positions(self, layout: DocumentLayout) -> torch.Tensor:
        """[B, T] the offsets in their documents of the positions the layer runs over: every one."""
        return layout.position_in_doc

    def rows(self, x_BT_: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The rows the recurrence and the convolutions run over: the batch's own."""
        return x_BT_

    def convolve(self, projected: torch.Tensor, short_conv: ShortConvolution, positions: torch.Tensor,
                 layout: DocumentLayout) -> torch.Tensor:
        """A short convolution and its SiLU over each row (nothing precedes a row's first position)."""
        return short_conv(projected, positions, None, silu=True)

    def recur(self, layer: "KimiDeltaAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The chunked delta rule over the packed documents (cu_seqlens segments of the flat batch)."""
        B, T = positions.shape
        flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        return kda(*flat, cu_seqlens=layout.cu_seqlens, document_bounds=layout.document_bounds,
                   chunk_size=layer.cfg.chunk_size, lower_bound=layer.gate_floor, fla=layer.fla)[0]


WHOLE_ROWS = WholeRows()


class KimiDeltaAttention(SequenceMixer):
    def __init__(self, dim: int, cfg: KDAConfig, *, norm_eps: float, init_std: float, out_std: float,
                 kernels: Kernels = REFERENCES):
        super().__init__()
        self.cfg = cfg
        self.fused = kernels.triton
        """The output norm (and its cast to the input's dtype) through our Triton kernel (gpu_kernels/rms_norm.py)."""
        self.fla = kernels.kda == "fla"
        """The chunked recurrence through fla's chunk_kda (Kernels.kda); else ops.kda's PyTorch chunk form."""
        self.norm_eps = norm_eps
        H, K = cfg.num_heads, cfg.head_dim
        inner = H * K
        self.q_proj = make_linear(dim, inner, init_std=init_std)
        self.k_proj = make_linear(dim, inner, init_std=init_std)
        self.v_proj = make_linear(dim, inner, init_std=init_std)
        self.q_conv = ShortConvolution(inner, cfg.conv_size, kernels)
        self.k_conv = ShortConvolution(inner, cfg.conv_size, kernels)
        self.v_conv = ShortConvolution(inner, cfg.conv_size, kernels)
        self.f_a_proj = make_linear(dim, K, init_std=init_std)
        self.f_b_proj = make_linear(K, inner, init_std=init_std)
        # fla's initialisation (docs/model.md): neither takes weight decay.
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.b_proj = make_linear(dim, H, init_std=init_std)
        self.g_proj = make_linear(dim, inner, init_std=init_std)
        self.o_norm_weight = nn.Parameter(torch.empty(K))
        self.param_init = {"A_log": a_log_init(cfg.gate), "dt_bias": dt_bias_init(), "o_norm_weight": Constant(1.0)}
        self.o_proj = make_linear(inner, dim, init_std=out_std)
        self.recompute_core = False
        """Recompute the chunked KDA op in backward (train.recompute lists core)."""
        self.recompute_pre = False
        """Recompute the pre-ops from the projections to the op's inputs (train.recompute lists kda_pre)."""
        self.split: WholeRows = WHOLE_ROWS
        """How the steps that see across positions run over this rank's rows (set by the activation plan)."""

    def set_recompute(self, modules: frozenset[str]) -> None:
        self.recompute_core, self.recompute_pre = "core" in modules, "kda_pre" in modules

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """Log decay g [B, T, H, K] from the low-rank logits f, in >= fp32."""
        dtype = compute_dtype(f.dtype)
        x = f.to(dtype) + self.dt_bias.to(dtype).view(-1, self.cfg.head_dim)
        rate = self.A_log.to(dtype).exp().view(-1, 1)
        if self.cfg.gate == "lower_bound":
            return self.cfg.lower_bound * torch.sigmoid(rate * x)
        return -rate * F.softplus(x)

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        K = self.cfg.head_dim
        positions = self.split.positions(layout)
        B, T = positions.shape  # this rank's positions, whatever tensor-parallel shard x holds
        pos = self.split.rows(positions, layout)
        projected = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)
        if self.recompute_pre and self.recompute_core:
            o = maybe_recompute(True, self._pre_and_recur, *projected, pos, layout)
        else:
            inputs = maybe_recompute(self.recompute_pre, self._pre_ops, *projected, pos, layout)
            o = maybe_recompute(self.recompute_core, self._recur, *inputs, pos, layout)
        o = rms_norm(o.reshape(B, T, -1, K), self.o_norm_weight, self.norm_eps, fused=self.fused, out_dtype=x.dtype)
        gate = torch.sigmoid(self._heads(self.g_proj(x)))
        return self.o_proj((gate * o).flatten(2))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:2], -1, self.cfg.head_dim)

    def _pre_ops(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                 pos: torch.Tensor, layout: DocumentLayout) -> tuple[torch.Tensor, ...]:
        """The projections -> the chunked op's (q, k, v, g, beta): short convolutions and SiLU, L2 norms, the
        decay gate and beta (train.recompute's kda_pre recomputes them)."""
        heads = self._heads
        q = l2_norm(heads(self.split.convolve(q, self.q_conv, pos, layout)), fused=self.fused)
        k = l2_norm(heads(self.split.convolve(k, self.k_conv, pos, layout)), fused=self.fused)
        v = heads(self.split.convolve(v, self.v_conv, pos, layout))
        g = self.decay(heads(self.split.rows(f, layout)))
        return q, k, v, g, torch.sigmoid(self.split.rows(b, layout).to(g.dtype))

    def _pre_and_recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                       pos: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """kda_pre and core as one region: from the projections to the op's output."""
        return self._recur(*self._pre_ops(q, k, v, f, b, pos, layout), pos, layout)

    def _recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               positions: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The recurrence as the split runs it (one region for train.recompute's core)."""
        return self.split.recur(self, q, k, v, g, beta, positions, layout)

    @property
    def gate_floor(self) -> float | None:
        """The decay's floor (every g >= it) with the bounded gate; None with softplus (unbounded)."""
        return self.cfg.lower_bound if self.cfg.gate == "lower_bound" else None
