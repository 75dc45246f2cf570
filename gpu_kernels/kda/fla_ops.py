"""fla's chunk KDA (fla-core 0.6.0: chunk_kda_fwd / chunk_kda_bwd) as two custom ops, so a dry run can play it.

fla's public chunk_kda is an autograd.Function, which a fake tensor cannot run (its Triton kernels need CUDA)
and the op census would see as the aten ops around its kernels only. Here its forward and backward are custom
ops with fake implementations (their results' shapes and dtypes, as fla allocates them) and a launch profile
(gpu_kernels/kda/fla_launches.py: each of fla's kernels with its FLOPs and the bytes it is handed), so the dry run
prices what a GPU runs. The forward keeps what fla's own Function keeps for its backward with
disable_recompute=False (q, k, v, beta, the gate's chunk cumsum, Aqk, Akk and the initial state); the backward
recomputes w, u and the chunk states h, as fla's does. The gate, the q / k L2 norm and beta's sigmoid stay in the
model (use_gate_in_kernel and its kin off), so this path computes exactly the reference's inputs.

The real implementations call fla's functions on the tensors' device: CUDA, or in the tests the CPU under Triton's
interpreter (pinned configs and shims: tests/unit/test_fla_cpu.py holds them against the PyTorch chunk form and a
float64 recurrence there). Nothing here has run on a GPU yet (docs/gpu.md): tests/gpu/test_fla_kda.py compares it
with the chunk form there, and tests/unit/test_fla_ops.py checks the fakes and the launch profile against fla's own
code on fake tensors, with its Triton launches intercepted.
"""

import itertools

import torch
from torch.library import custom_op
from torch.utils.weak import WeakIdKeyDictionary

from gpu_kernels.kda.fla_backend import safe_gate_reason

SUB_CHUNK = 16
"""fla's sub-chunk inside a chunk (BC = min(16, chunk)): its diagonal blocks of Akk are kept in fp32."""


_tables: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""cu_seqlens tensor -> {chunk: its tables}, while the tensor lives: every KDA layer of a forward (and its
recomputation) is handed the same cu_seqlens object (model/layout.py builds it once per forward), so its tables
are built once, however the forwards and recomputations of several micro-batches interleave
(parallel.overlap_micro_batches)."""


def tables_for(cu_seqlens: torch.Tensor, bounds: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_tables for this cu_seqlens tensor, made once per tensor and chunk (fla's own tensor_cache keeps
    only the latest): two host-to-device copies a forward rather than a layer."""
    by_chunk = _tables.setdefault(cu_seqlens, {})
    if chunk not in by_chunk:
        by_chunk[chunk] = chunk_tables(bounds, chunk, cu_seqlens.device)
    return by_chunk[chunk]


def chunk_tables(bounds: list[int], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk_indices [NT, 2] (document, chunk within it) and chunk_offsets [N + 1] (chunks before each
    document) from the document bounds as host integers: what fla derives from cu_seqlens on the device (several
    small launches and a host sync per layer), built on the host instead (two small copies to the device)."""
    counts = [-(-(end - start) // chunk) for start, end in itertools.pairwise(bounds)]
    indices = [(doc, i) for doc, n in enumerate(counts) for i in range(n)]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return (torch.tensor(indices, dtype=torch.int64, device=device).view(-1, 2),
            torch.tensor(offsets, dtype=torch.int64, device=device))


def _no_state(q: torch.Tensor) -> torch.Tensor:
    """The empty tensor a custom op returns where fla returns None (no final state, no initial state's grad)."""
    return q.new_empty(0, dtype=torch.float32)


def _states(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    return q.new_empty(N, H, K, v.shape[-1], dtype=torch.float32)


def fla_forward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale, chunk_size,
                lower_bound, output_final_state) -> tuple[torch.Tensor, ...]:
    """The forward op's implementation: fla's chunk_kda_fwd on the tensors' device (the current CUDA device: the trainer
    sets each rank's), taking what fla's own Function would keep for the backward."""
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    o, final_state, g_cumsum, Aqk, Akk, *_ = chunk_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets, chunk_size=chunk_size, safe_gate=lower_bound is not None,
        lower_bound=lower_bound)
    return o, final_state if output_final_state else _no_state(q), g_cumsum, Aqk, Akk


@custom_op("moe_pretrain::fla_chunk_kda", mutates_args=())
def fla_chunk_kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                          chunk_indices: torch.Tensor | None, chunk_offsets: torch.Tensor | None, scale: float,
                          chunk_size: int, lower_bound: float | None, output_final_state: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 (empty unless asked), the gate's chunk-local
    cumsum fp32 [B, T, H, K], Aqk and Akk [B, T, H, chunk] in k's dtype): fla's chunk_kda_fwd."""
    return fla_forward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale,
                       chunk_size, lower_bound, output_final_state)


@fla_chunk_kda_forward.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale, chunk_size, lower_bound,
      output_final_state):
    B, T, H, _ = q.shape
    A = k.new_empty(B, T, H, chunk_size)
    final_state = _states(q, v, cu_seqlens) if output_final_state else _no_state(q)
    return torch.empty_like(v), final_state, g.new_empty(g.shape, dtype=torch.float32), A, torch.empty_like(A)


def fla_backward(q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, do, dht, cu_seqlens, chunk_indices,
                 chunk_offsets, scale, chunk_size, lower_bound) -> tuple[torch.Tensor, ...]:
    """The backward op's implementation: fla's chunk_kda_bwd (recomputing w, u and h)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd

    dq, dk, dv, db, dg, dh0, *_ = chunk_kda_bwd(
        q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=scale, initial_state=initial_state, do=do, dht=dht,
        g=g_cumsum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        chunk_size=chunk_size, safe_gate=lower_bound is not None, lower_bound=lower_bound)
    return dq, dk, dv, db, dg, dh0 if initial_state is not None else _no_state(q)


@custom_op("moe_pretrain::fla_chunk_kda_backward", mutates_args=())
def fla_chunk_kda_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                           g_cumsum: torch.Tensor, Aqk: torch.Tensor, Akk: torch.Tensor,
                           initial_state: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None,
                           cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                           chunk_offsets: torch.Tensor | None, scale: float, chunk_size: int,
                           lower_bound: float | None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """(dq, dk fp32, dv in v's dtype, dbeta fp32, dg fp32, d initial state fp32 (empty without one)), as fla's
    chunk_kda_bwd returns them; the caller casts them to its inputs' dtypes (seen by the census as casts)."""
    return fla_backward(q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, do, dht, cu_seqlens, chunk_indices,
                        chunk_offsets, scale, chunk_size, lower_bound)


@fla_chunk_kda_backward.register_fake
def _(q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, do, dht, cu_seqlens, chunk_indices, chunk_offsets, scale,
      chunk_size, lower_bound):
    d_initial = torch.empty_like(initial_state) if initial_state is not None else _no_state(q)
    fp32 = torch.float32
    return (torch.empty_like(q, dtype=fp32), torch.empty_like(k, dtype=fp32), torch.empty_like(v),
            torch.empty_like(beta, dtype=fp32), torch.empty_like(g_cumsum), d_initial)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, *settings = inputs
    _, _, g_cumsum, Aqk, Akk = output
    ctx.save_for_backward(q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, cu_seqlens, chunk_indices,
                          chunk_offsets)
    ctx.scale, ctx.chunk_size, ctx.lower_bound, ctx.output_final_state = settings
    ctx.dtypes = g.dtype, beta.dtype
    ctx.mark_non_differentiable(g_cumsum, Aqk, Akk)


def _backward(ctx, d_o, d_final, *_):
    q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, cu_seqlens, chunk_indices, chunk_offsets = ctx.saved_tensors
    dht = d_final.contiguous() if ctx.output_final_state else None
    dq, dk, dv, db, dg, dh0 = fla_chunk_kda_backward(
        q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, d_o.contiguous(), dht, cu_seqlens, chunk_indices,
        chunk_offsets, ctx.scale, ctx.chunk_size, ctx.lower_bound)
    g_dtype, beta_dtype = ctx.dtypes
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g_dtype), db.to(beta_dtype),
            dh0 if initial_state is not None else None, None, None, None, None, None, None, None)


fla_chunk_kda_forward.register_autograd(_backward, setup_context=_save)


def fla_chunk_kda(q, k, v, g, beta, *, scale: float, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, document_bounds: list[int] | None, output_final_state: bool,
                  chunk_size: int = 64, lower_bound: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunk KDA with ops.kda's contract -> (o in q's dtype, final state or None). lower_bound (the
    bounded gate's floor) turns on fla's safe-gate path; the gate itself stays ours (g arrives computed)."""
    if reason := safe_gate_reason(lower_bound):
        raise ValueError(reason)
    tables = (None, None) if cu_seqlens is None else tables_for(cu_seqlens, document_bounds, chunk_size)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()  # fla keeps its states in fp32
    o, final_state, *_ = fla_chunk_kda_forward(
        q, k, v, g, beta, initial_state, None if cu_seqlens is None else cu_seqlens.long(), *tables, scale,
        chunk_size, lower_bound, output_final_state)
    return o.to(q.dtype), final_state if output_final_state else None
