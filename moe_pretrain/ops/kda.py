"""Kimi Delta Attention, the delta rule with channel-wise decay (docs/model.md, "KDA").

Shapes (fla's chunk_kda conventions): q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay,
<= 0); beta [B, T, H]; states [B, H, K, V] (or [N, H, K, V], one per document, with cu_seqlens).

Per token:  S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t).

Chunked form (chunk C, used for training). Inside a chunk let G_t = cumsum(g)_t and S0 the entry state.
Writing S_t = Diag(e^{G_t}) (S0 + sum_{s<=t} Diag(e^{-G_s}) k_s w_s^T) turns the recurrence into the
unit-lower-triangular system (I + A) W = Diag(beta) (V - (K * e^G) S0), with
A_ts = beta_t sum_c k_tc k_sc e^{G_tc - G_sc} for s < t. Its solution is W = U - Wk S0, where
U = (I + A)^-1 Diag(beta) V and Wk = (I + A)^-1 Diag(beta) (K * e^G) (the WY / UT representation),
so everything but a C-step-free chain over chunks is batched:
    O = (Q * e^G) S0 + P W,  P_ts = sum_c q_tc k_sc e^{G_tc - G_sc} (s <= t),
    S_C = Diag(e^{G_C}) S0 + (K * e^{G_C - G})^T W.
Every exponent formed is <= 0 (never e^{-G} alone), so the form stays finite for any decay (64 steps
at the -5 lower bound would overflow e^{-G} in fp32); see _intra_chunk_products.
"""

import itertools
import math
from collections.abc import Callable

import torch

from gpu_kernels.kda import fla_chunk_kda
from moe_pretrain.ops.norms import compute_dtype


def _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, bounds: list[int] | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"kda: q, k, g must share one [B, T, H, K] shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}"
        )
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"kda: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"kda: beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"kda: cu_seqlens needs packed input with B == 1, got B = {B}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError("kda: cu_seqlens must be a 1-D integer tensor of document offsets")
        if bounds is None or len(bounds) != cu_seqlens.numel():
            raise ValueError(f"kda: document_bounds must be cu_seqlens as host integers ({cu_seqlens.numel()} "
                             f"of them), got {None if bounds is None else len(bounds)}")
        if bounds[0] != 0 or bounds[-1] != T or any(b >= e for b, e in itertools.pairwise(bounds)):
            raise ValueError(f"kda: cu_seqlens must rise strictly from 0 to T={T}, got {bounds}")
    state_shape = (B if cu_seqlens is None else cu_seqlens.numel() - 1, H, q.shape[-1], v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"kda: initial_state must be {list(state_shape)}, got {list(initial_state.shape)}")


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    document_bounds: list[int] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    lower_bound: float | None = None,
    fla: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA -> (o [B, T, H, V] in q's dtype, final_state [B or N, H, K, V] fp32+ or None).

    fla=True (Kernels.kda, resolved where fla runs: CUDA) calls fla's Triton chunk_kda; otherwise this runs the
    vectorised PyTorch chunk algorithm of this module (autograd-differentiable), which is the reference.
    lower_bound: the bounded gate's floor when g comes from it (g >= lower_bound); fla then takes its
    safe-gate path (safe_gate=True, lower_bound), which the bound makes exact; the reference then sizes its
    sub-blocks from the bound alone, reading nothing of g on the host (_sub_block_size).
    document_bounds: cu_seqlens as host integers, when the caller holds them already (the model reads them
    once per forward, DocumentLayout.document_bounds, and every layer shares them); without them kda reads
    cu_seqlens once. fla reads its own chunk indices from cu_seqlens, cached for the same tensor object.
    """
    if cu_seqlens is not None and document_bounds is None:
        document_bounds = cu_seqlens.tolist()
    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, document_bounds)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if fla:
        return fla_chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            document_bounds=document_bounds, output_final_state=output_final_state, chunk_size=chunk_size,
            lower_bound=lower_bound,
        )
    if cu_seqlens is None:
        o, state = _chunk_kda(q, k, v, g, beta, scale, initial_state, chunk_size, lower_bound)
    elif initial_state is None and not output_final_state:
        starts = document_starts(cu_seqlens, q.shape[1]).unsqueeze(0)
        o, state = _chunk_kda(q, k, v, g, beta, scale, None, chunk_size, lower_bound, starts)
    else:
        o, state = _per_document(_chunk_kda, q, k, v, g, beta, scale, initial_state, document_bounds,
                                 chunk_size, lower_bound)
    return o, (state if output_final_state else None)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA: the test oracle and the decoding form. Same contract as kda()."""
    bounds = None if cu_seqlens is None else cu_seqlens.tolist()
    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, bounds)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        o, state = _recurrent_kda(q, k, v, g, beta, scale, initial_state)
    else:
        o, state = _per_document(_recurrent_kda, q, k, v, g, beta, scale, initial_state, bounds)
    return o, (state if output_final_state else None)


def _recurrent_kda(q, k, v, g, beta, scale, initial_state):
    B, T, H, K = q.shape
    dtype = compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + beta[:, t, :, None, None] * k_t.unsqueeze(-1) * residual.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, v.shape[-1])
    return o, state


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] (T a multiple of chunk) -> [B, H, N, chunk, ...]."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // chunk, chunk, H, *x.shape[3:])
    return x.movedim(3, 1)


def _decay(exponent: torch.Tensor) -> torch.Tensor:
    """e^x for log decays x <= 0, floored at the dtype's smallest normal number instead of reaching
    subnormals or zero: exp's subnormal path is 5-15x slower on x86 (measured: 26 ms for 1M fp32 values
    near -95 against 1.6 ms near -1). The floor (1e-38 in fp32) is far below any term's resolution."""
    return exponent.clamp_min(math.log(torch.finfo(exponent.dtype).tiny) + 1.0).exp()


def _sub_block_size(G: torch.Tensor, lower_bound: float | None = None) -> int:
    """The largest sub-block size (a power-of-two divisor of the chunk C, at most C) whose decay factors
    stay safely finite: every |G_t - G_m| inside a block, m its middle position, at most half the log of
    the dtype's largest value (e^44 in fp32, e^354 in fp64), so e^{G_t - G_m} and its reciprocal are
    normal numbers with room for the inputs' own scale. Size 1 always qualifies. Mild decays (a freshly
    initialised model) take the whole chunk; the lower-bound gate's strongest (-5 per token) takes 16.

    With the gate's floor known (every g >= lower_bound) the size follows from it alone, without reading G:
    inside a block |G_t - G_m| <= |lower_bound| * (sub // 2), so no host sync, and the same size for every
    layer and step (16 at -5 in fp32). Without a floor (the softplus gate) the decays are read: one host
    sync per call.
    """
    C = G.shape[-2]
    limit = 0.5 * math.log(torch.finfo(G.dtype).max)
    sub = C
    while sub > 1:
        if C % sub == 0 and lower_bound is not None:
            if -lower_bound * (sub // 2) <= limit:
                return sub
        elif C % sub == 0:
            blocks = G.unflatten(-2, (C // sub, sub))
            first, middle, last = blocks[..., 0, :], blocks[..., sub // 2, :], blocks[..., -1, :]
            # G falls monotonically, so the block's extremes are its ends.
            if float(torch.maximum(first - middle, middle - last).max().detach()) <= limit:
                return sub
        sub //= 2
    return 1


class _BlockDecays:
    """Decay factors of a chunk split into sub-blocks of `sub` positions with reference m, each block's
    middle: e^{G_t - G_m} for rows and its reciprocal e^{G_m - G_s} for columns (both bounded by
    _sub_block_size), and e^{G_{m_i} - G_{m_j}} <= 1 between the references of blocks j < i."""

    def __init__(self, G: torch.Tensor, sub: int):
        *self.lead, C, self.K = G.shape
        self.n, self.sub = C // sub, sub
        Gb = self.blocks(G)
        self.reference = Gb[..., sub // 2 : sub // 2 + 1, :]  # [..., n, 1, K]
        self.row = (Gb - self.reference).exp()
        self.column = self.row.reciprocal()

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*self.lead, self.n, self.sub, self.K)


def _intra_chunk_products(q, k, d: _BlockDecays):
    """P_ts = sum_c q_tc k_sc e^{G_tc - G_sc} and A'_ts, the same with k_t for q_t, both for s <= t.

    Inputs [..., C, K] -> two [..., C, C]. Through the block references m: inside block i,
    e^{G_t - G_s} = e^{G_t - G_{m_i}} e^{G_{m_i} - G_s} (one matmul per block, masked causal); for s in an
    earlier block j < i, e^{G_t - G_{m_i}} e^{G_{m_i} - G_{m_j}} e^{G_{m_j} - G_s}. Every factor is a
    normal number whatever the decay (_sub_block_size), and the only elementwise work beyond O(C K) is
    the per-channel middle factor over the n (n - 1) / 2 block pairs, nothing at one sub-block per chunk.
    """
    n, sub, lead = d.n, d.sub, d.lead
    C = n * sub
    rows_q, rows_k = d.blocks(q) * d.row, d.blocks(k) * d.row
    columns = d.blocks(k) * d.column
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    # between[d - 1] = e^{G_{m_i} - G_{m_{i-d}}} for i >= d: block pairs d apart, as views, no gathers.
    between = [_decay(d.reference[..., gap:, :, :] - d.reference[..., :-gap, :, :]) for gap in range(1, n)]

    def products(rows):  # rows [..., n, sub, K] -> [..., C, C]
        full = rows.new_zeros(*lead, n, n, sub, sub)  # [..., block i, block j, t, u]
        full.diagonal(0, -4, -3).copy_(
            (rows @ columns.transpose(-1, -2)).masked_fill(~causal, 0.0).movedim(-3, -1))
        for gap, factor in enumerate(between, start=1):
            block = (rows[..., gap:, :, :] * factor) @ columns[..., :-gap, :, :].transpose(-1, -2)
            full.diagonal(-gap, -4, -3).copy_(block.movedim(-3, -1))
        return full.transpose(-3, -2).reshape(*lead, C, C)

    return products(rows_q), products(rows_k)


class _PreparedChunks:
    """Everything of the chunked form that does not depend on the entry state, batched over chunks.

    doc_starts (bool [B, T] or None) marks positions where a document begins: the state resets there, so
    documents of any lengths share the chunks of one packed sequence (memory linear in T); the entry state
    feeds only the tokens before a row's first start (none when its position 0 starts a document).

    Per chunk n with entry state S_n the module docstring's form is, with carry = tokens still in the
    entry's document and last = tokens of the chunk's final document,
        O = Qe S_n + P U,  Qe = Q e^G carry - P Wk,
        S_{n+1} = M_n S_n + B_n,  M_n = Diag(e^{G_C} carry_C) - (Kd last)^T Wk,  B_n = (Kd last)^T U,
    so the only sequential step is S <- M S + B over chunks (outputs()) and everything else is batched
    matmuls. The same per-chunk (M_n, B_n) compose into the affine map of the whole row (summary()),
    which is what context parallelism exchanges between ranks.
    """

    def __init__(self, q, k, v, g, beta, scale: float, chunk: int, lower_bound: float | None = None,
                 doc_starts: torch.Tensor | None = None):
        B, T, H, K = q.shape
        V = v.shape[-1]
        self.shape, self.out_dtype = (B, T, H, K, V), q.dtype
        dtype = self.dtype = compute_dtype(q.dtype)
        self.pad = pad = (-T) % chunk
        # Zero padding at the end is inert: beta = 0 writes nothing, g = 0 decays nothing.
        if pad:
            q, k, v, g, beta = (
                torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta)
            )
        q, k, v, g, beta = (_to_chunks(x.to(dtype), chunk).contiguous() for x in (q * scale, k, v, g, beta))
        G = g.cumsum(dim=-2)
        P, Akk = _intra_chunk_products(q, k, _BlockDecays(G, _sub_block_size(G, lower_bound)))
        carry = last = carry_end = None  # no document boundary: every token carries the entry state
        if doc_starts is not None:
            segment = torch.nn.functional.pad(doc_starts, (0, pad)).view(B, 1, -1, chunk).cumsum(-1)  # [B,1,N,C]
            same = segment.unsqueeze(-1) == segment.unsqueeze(-2)
            P, Akk = P * same, Akk * same
            carry = (segment == 0).unsqueeze(-1).to(dtype)  # [B, 1, N, C, 1]
            last = (segment == segment[..., -1:]).unsqueeze(-1).to(dtype)
            carry_end = carry[..., -1:, :]
        A = (Akk * beta.unsqueeze(-1)).tril(-1)
        eye = torch.eye(chunk, dtype=dtype, device=q.device)
        eG = _decay(G)
        rhs = beta.unsqueeze(-1) * torch.cat([v, _masked(k * eG, carry)], dim=-1)
        solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        self.P_U, P_Wk = (P @ solved).split([V, K], dim=-1)
        self.Qe = _masked(q * eG, carry) - P_Wk
        G_end = G[..., -1:, :]
        Kd_t = _masked(k * _decay(G_end - G), last).transpose(-1, -2)  # [B, H, N, K, C]
        self.B_c, Kd_Wk = (Kd_t @ solved).split([V, K], dim=-1)  # [B, H, N, K, V], [B, H, N, K, K]
        self.M = torch.diag_embed(_masked(_decay(G_end), carry_end).squeeze(-2)) - Kd_Wk

    def zero_state(self) -> torch.Tensor:
        B, _, H, K, V = self.shape
        return self.M.new_zeros(B, H, K, V)

    def outputs(self, initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (o [B, T, H, V] in the input dtype, the state after the last token)."""
        B, T, H, _, V = self.shape
        state = self.zero_state() if initial_state is None else initial_state.to(self.dtype)
        entries = []
        for M_n, B_n in zip(self.M.unbind(2), self.B_c.unbind(2), strict=True):  # unbind: one backward copy
            entries.append(state)
            state = M_n @ state + B_n
        o = self.Qe @ torch.stack(entries, dim=2) + self.P_U  # [B, H, N, C, V]
        o = o.movedim(1, 3).reshape(B, T + self.pad, H, V)[:, :T]
        return o.to(self.out_dtype), state

    def summary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's affine map S_out = M S_in + B -> (M [B, H, K, K], B [B, H, K, V]); M = 0 when a document
        starts inside the row (its state never reaches the end)."""
        M, Bs = self.M[:, :, 0], self.B_c[:, :, 0]
        for M_n, B_n in zip(self.M.unbind(2)[1:], self.B_c.unbind(2)[1:], strict=True):
            M, Bs = M_n @ M, M_n @ Bs + B_n
        return M, Bs


def _in_compute_dtype(device: torch.device):
    """The chunk form's matmuls in its compute dtype (fp32 or wider): autocast would return them in bf16, the
    chain over chunks and the state summaries context parallelism exchanges included."""
    return torch.autocast(device.type, enabled=False)


def _chunk_kda(q, k, v, g, beta, scale, initial_state, chunk, lower_bound=None, doc_starts=None):
    """Chunked KDA over [B, T, H, .] -> (o, state after the last token); see _PreparedChunks."""
    with _in_compute_dtype(q.device):
        return _PreparedChunks(q, k, v, g, beta, scale, chunk, lower_bound, doc_starts).outputs(initial_state)


def kda_with_entry_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_starts: torch.Tensor,
    entry_states: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA over pieces of longer sequences whose entry states come from elsewhere (context parallel).

    q, k, g [P, L, H, K], v [P, L, H, V], beta [P, L, H]: P pieces; doc_starts [P, L] bool.
    entry_states(M [P, H, K, K], B [P, H, K, V]) receives each piece's affine summary (S_out = M S_in + B,
    from its own tokens) and returns each piece's entry state [P, H, K, V] (differentiably: gradients
    reach the summaries). The intra-chunk work is done once; only the chain over chunks runs twice.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    with _in_compute_dtype(q.device):
        prepared = _PreparedChunks(q, k, v, g, beta, scale, chunk_size, lower_bound, doc_starts)
        return prepared.outputs(entry_states(*prepared.summary()))[0]


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


def _per_document(fn, q, k, v, g, beta, scale, initial_state, bounds: list[int], *extra):
    """Each document of a packed sequence on its own, from its own initial state -> (o, [N, H, K, V]).

    Used when per-document initial or final states are asked for (decoding, tests); training, which
    needs neither, runs all documents in one pass (_chunk_kda with doc_starts)."""
    outputs, states = [], []
    for doc, (start, end) in enumerate(itertools.pairwise(bounds)):
        h0 = None if initial_state is None else initial_state[doc : doc + 1]
        o, state = fn(*(x[:, start:end] for x in (q, k, v, g, beta)), scale, h0, *extra)
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, dim=1), torch.cat(states)


def document_starts(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """cu_seqlens [N + 1] -> bool [length], True where a document begins."""
    starts = torch.zeros(length, dtype=torch.bool, device=cu_seqlens.device)
    starts[cu_seqlens[:-1]] = True
    return starts
