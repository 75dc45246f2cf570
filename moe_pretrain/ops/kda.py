"""Kimi Delta Attention, the delta rule with channel-wise decay (MODEL.md, "KDA").

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

import torch

from kernels.kda import fla_chunk_kda, fla_chunk_kda_supported
from moe_pretrain.ops.norms import compute_dtype


def _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
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
        bounds = cu_seqlens.tolist()
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
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA -> (o [B, T, H, V] in q's dtype, final_state [B or N, H, K, V] fp32+ or None).

    On CUDA with fla installed this calls fla's Triton chunk_kda; elsewhere it runs the vectorised
    PyTorch chunk algorithm of this module (autograd-differentiable), which is the reference.
    """
    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if fla_chunk_kda_supported(q):
        return fla_chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, output_final_state=output_final_state,
        )
    if cu_seqlens is None:
        o, state = _chunk_kda(q, k, v, g, beta, scale, initial_state, chunk_size)
    else:
        o, state = _packed(_chunk_kda, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
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
    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        o, state = _recurrent_kda(q, k, v, g, beta, scale, initial_state)
    else:
        o, state = _packed(_recurrent_kda, q, k, v, g, beta, scale, initial_state, cu_seqlens)
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


def _intra_chunk_products(q, k, G, sub: int = 8):
    """P_ts = sum_c q_tc k_sc e^{G_tc - G_sc} (s <= t) and A'_ts the same with k_t for q_t (s <= t).

    Inputs [..., C, K] -> two [..., C, C]. Off-diagonal sub-blocks (row block i, columns before its
    start r_i) factor through the reference G_{r_i}: e^{G_t - G_s} = e^{G_t - G_{r_i}} e^{G_{r_i} - G_s},
    both factors <= 1 because G only falls. Only the small diagonal sub-blocks are formed pairwise,
    which keeps the elementwise work at O(C * sub * K) instead of O(C^2 * K).
    """
    *lead, C, K = G.shape
    sub = sub if C % sub == 0 else C
    n = C // sub
    G_blocks = G.reshape(*lead, n, sub, K)
    ref = G_blocks[..., :1, :]  # [..., n, 1, K]: G at each row block's first position
    row_decay = (G_blocks - ref).exp()
    q_row = q.reshape(*lead, n, sub, K) * row_decay
    k_row = k.reshape(*lead, n, sub, K) * row_decay
    positions = torch.arange(C, device=G.device)
    before = positions < (torch.arange(n, device=G.device) * sub).unsqueeze(-1)  # [n, C]
    col_exponent = (ref - G.unsqueeze(-3)).masked_fill(~before.unsqueeze(-1), float("-inf"))
    k_col = k.unsqueeze(-3) * col_exponent.exp()  # [..., n, C, K], zero at and after block i
    off_qk = q_row @ k_col.transpose(-1, -2)  # [..., n, sub, C]
    off_kk = k_row @ k_col.transpose(-1, -2)
    incl = torch.ones(sub, sub, dtype=torch.bool, device=G.device).tril()
    diff = (G_blocks.unsqueeze(-2) - G_blocks.unsqueeze(-3)).masked_fill(~incl.unsqueeze(-1), float("-inf"))
    k_diag = diff.exp() * k.reshape(*lead, n, 1, sub, K)  # [..., n, sub(t), sub(s), K]
    eye = torch.eye(n, dtype=G.dtype, device=G.device)

    def assemble(off, a):
        diag = (a.reshape(*lead, n, sub, 1, K) * k_diag).sum(-1)  # [..., n, sub, sub]
        block_diag = torch.einsum("...itu,ij->...itju", diag, eye)
        return (off.reshape(*lead, n, sub, n, sub) + block_diag).reshape(*lead, C, C)

    return assemble(off_qk, q), assemble(off_kk, k)


def _chunk_kda(q, k, v, g, beta, scale, initial_state, chunk):
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    pad = (-T) % chunk
    # Zero padding at the end is inert: beta = 0 writes nothing, g = 0 decays nothing.
    q, k, v, g, beta = (
        torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta)
    )
    q, k, v, g, beta = (_to_chunks(x, chunk) for x in (q * scale, k, v, g, beta))  # [B, H, N, C, .]
    G = g.cumsum(dim=-2)
    decay_qk, decay_kk = _intra_chunk_products(q, k, G)
    A = (decay_kk * beta.unsqueeze(-1)).tril(-1)
    P = decay_qk
    eye = torch.eye(chunk, dtype=dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * torch.cat([v, k * G.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, Wk = solved[..., :V], solved[..., V:]
    Qg = q * G.exp()
    G_end = G[..., -1:, :]  # [B, H, N, 1, K]
    Kd = k * (G_end - G).exp()
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for n in range(q.shape[2]):
        W = U[:, :, n] - Wk[:, :, n] @ state
        outputs.append(Qg[:, :, n] @ state + P[:, :, n] @ W)
        state = state * G_end[:, :, n].exp().transpose(-1, -2) + Kd[:, :, n].transpose(-1, -2) @ W
    o = torch.stack(outputs, dim=2)  # [B, H, N, C, V]
    o = o.movedim(1, 3).reshape(B, T + pad, H, V)[:, :T]
    return o.to(out_dtype), state


def _packed(fn, q, k, v, g, beta, scale, initial_state, cu_seqlens, *extra):
    """Run fn on documents laid out as a padded batch [N, L, ...] and pack the result back.

    Each document starts from its own initial state (zero by default), so no state crosses a
    document boundary; the padding sits after each document's end and is inert (see _chunk_kda).
    """
    bounds = cu_seqlens.to(torch.int64)
    T = q.shape[1]
    lengths = bounds[1:] - bounds[:-1]
    positions = torch.arange(T, device=q.device)
    doc = torch.searchsorted(bounds[1:], positions, right=True)
    offset = positions - bounds[doc]
    longest = int(lengths.max())

    def unpack(x):
        padded = x.new_zeros(lengths.numel(), longest, *x.shape[2:])
        return padded.index_put((doc, offset), x[0])

    o, state = fn(*(unpack(x) for x in (q, k, v, g, beta)), scale, initial_state, *extra)
    return o[doc, offset].unsqueeze(0), state
