"""What fla-core 0.6.0's chunk KDA launches, kernel by kernel, for the op census (gpu_kernels/launch_profile.py).

Read from fla's source (fla/ops/kda/chunk_fwd.py, chunk_bwd.py, chunk_intra.py, wy_fast.py,
fla/ops/common/chunk_delta_h.py, fla/ops/gla/chunk.py) and checked against it: tests/unit/test_fla_ops.py runs
fla's chunk_kda_fwd / chunk_kda_bwd on fake tensors with Triton's launches intercepted and compares each kernel's
name and the bytes of the tensors it is handed with the profile here, for packed documents, rows, both dtypes,
initial and final states. A new fla version that launches differently fails that test before it misprices a
step.

FLOPs per token and head, chunk C, sub-chunk S (16), key width K, value width V, the intra-chunk products
counted over their causal half (as model/counts.py counts the chunked form):
  forward  - Aqk and Akk inside the sub-chunks 2 S K, between them 2 C K - 2 S K; w and u C (K + V);
             the chunk states 4 K V; the output 2 K V + C V.   Sum: 2 C K + C (K + V) + C V + 6 K V.
  backward - w, u and the states recomputed: C (K + V) + 4 K V; dAqk and dv 2 C V; the states' gradients
             6 K V; dq, dk, dw and the WY form's 6 K V + 2 C (K + V); the intra-chunk gradients 4 C K.
             Sum: twice the forward plus the recomputation.
"""

import torch

from gpu_kernels.kda.fla_ops import SUB_CHUNK  # and the ops themselves, registered on import
from gpu_kernels.launch_profile import Launch, register_launches

FLA = "fla."
"""The census files fla's launches under fla.<its kernel's name> (its own aten ops too: fla.zeros)."""


class _Sizes:
    """Bytes of the tensors fla's kernels are handed, by role, from the op's arguments."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                 cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, chunk_size: int):
        B, T, H, K = q.shape
        V = v.shape[-1]
        self.tokens, self.heads, self.K, self.V, self.C = B * T, H, K, V, chunk_size
        chunks = B * -(-T // chunk_size) if chunk_indices is None else chunk_indices.shape[0]
        rows = B * T * H
        fp32 = 4
        self.q, self.k = rows * K * q.element_size(), rows * K * k.element_size()
        self.v = rows * V * v.element_size()
        self.beta, self.beta32 = rows * beta.element_size(), rows * fp32
        self.key32 = rows * K * fp32  # the gate's cumsum; dq, dk, dg in the backward
        self.A, self.A32 = rows * chunk_size * k.element_size(), rows * chunk_size * fp32
        self.A_sub32 = rows * SUB_CHUNK * fp32
        self.w = rows * K * k.element_size()  # w and kg
        self.u = rows * V * v.element_size()  # u, v_new, do, dv
        self.h = chunks * H * K * V * k.element_size()  # the chunk states (and their gradients, in q's dtype)
        self.dh = chunks * H * K * V * q.element_size()
        self.state = (B if cu_seqlens is None else cu_seqlens.numel() - 1) * H * K * V * fp32
        self.cu = 0 if cu_seqlens is None else cu_seqlens.numel() * 8
        self.index = self.cu + (0 if cu_seqlens is None else chunk_indices.numel() * 8)
        """cu_seqlens with chunk_indices: what the kernels that walk chunks are handed."""
        self.offsets = 2 * self.cu
        """cu_seqlens with chunk_offsets (one more than the documents too): what the state kernels are handed."""
        self.k_blocks = -(-K // min(32, 1 << (K - 1).bit_length()))  # fla's NK partial sums of dbeta

    def flops(self, per_token_head: int) -> int:
        return self.tokens * self.heads * per_token_head


def _states(s: _Sizes, initial_state: torch.Tensor | None, final_state: bool) -> int:
    return s.state * ((initial_state is not None) + final_state)


@register_launches(torch.ops.moe_pretrain.fla_chunk_kda)
def _forward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale, chunk_size,
             lower_bound, output_final_state, *, out) -> list[Launch]:
    s = _Sizes(q, k, v, beta, cu_seqlens, chunk_indices, chunk_size)
    C, S, K, V = s.C, SUB_CHUNK, s.K, s.V
    g_bytes = g.numel() * g.element_size()
    # The safe gate's bound lets one program take a sub-chunk; without it fla splits the work token by token.
    intra, intra_index = ("chunk_kda_fwd_kernel_intra_sub_chunk", s.index) if lower_bound is not None else \
        ("chunk_kda_fwd_kernel_intra_token_parallel", s.cu)
    final_state = [Launch(FLA + "new_zeros", 0, s.k + s.state)] if output_final_state else []
    return [
        Launch(FLA + "chunk_local_cumsum_vector_kernel", 0, g_bytes + s.key32 + s.index),
        Launch(FLA + "zeros", 0, s.A),
        Launch(FLA + intra, s.flops(2 * S * K),
               s.q + s.k + s.key32 + s.beta + s.A + s.A_sub32 + intra_index),
        Launch(FLA + "chunk_kda_fwd_kernel_inter_solve_fused", s.flops(2 * C * K - 2 * S * K),
               s.q + s.k + s.key32 + s.beta + 2 * s.A + s.A_sub32 + s.index),
        Launch(FLA + "recompute_w_u_fwd_kda_kernel", s.flops(C * (K + V)),
               s.k + s.v + s.beta + 2 * s.w + s.u + s.A + s.key32 + s.index),
        *final_state,
        Launch(FLA + "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", s.flops(4 * K * V),
               s.w * 2 + s.u * 2 + s.key32 + s.h + _states(s, initial_state, output_final_state) + s.offsets),
        Launch(FLA + "zeros_like", 0, 2 * s.v),  # the census counts the argument as read
        Launch(FLA + "chunk_gla_fwd_kernel_o", s.flops(2 * K * V + C * V),
               s.q + s.u + s.key32 + s.h + s.v + s.A + s.index),
    ]


@register_launches(torch.ops.moe_pretrain.fla_chunk_kda_backward)
def _backward(q, k, v, beta, g_cumsum, Aqk, Akk, initial_state, do, dht, cu_seqlens, chunk_indices, chunk_offsets,
              scale, chunk_size, lower_bound, *, out) -> list[Launch]:
    s = _Sizes(q, k, v, beta, cu_seqlens, chunk_indices, chunk_size)
    C, K, V = s.C, s.K, s.V
    states = _states(s, initial_state, dht is not None)
    return [
        Launch(FLA + "recompute_w_u_fwd_kda_kernel", s.flops(C * (K + V)),  # with q in, q * e^G out
               s.q + s.k + s.v + s.beta + 3 * s.w + s.u + s.A + s.key32 + s.index),
        Launch(FLA + "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", s.flops(4 * K * V),
               s.w * 2 + s.u * 2 + s.key32 + s.h + (s.state if initial_state is not None else 0) + s.offsets),
        Launch(FLA + "chunk_kda_bwd_kernel_dAv", s.flops(2 * C * V), s.q + s.k + s.u * 3 + s.A + s.A32 + s.index),
        Launch(FLA + "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", s.flops(6 * K * V),
               s.q + s.k + s.w + s.key32 + s.u * 3 + s.dh + states + s.offsets),
        Launch(FLA + "chunk_kda_bwd_kernel_wy_dqkg_fused", s.flops(6 * K * V + 2 * C * (K + V)),
               s.q + s.k + s.v + s.u * 4 + s.key32 * 4 + s.beta + s.beta32 + s.A + s.A32 + s.h + s.dh
               + s.index),
        Launch(FLA + "chunk_kda_bwd_kernel_intra", s.flops(4 * C * K),
               s.q + s.k + s.key32 * 7 + s.beta + s.A32 * 2 + s.beta32 * s.k_blocks + s.index),
        Launch(FLA + "sum", 0, s.beta32 * (s.k_blocks + 1)),
        Launch(FLA + "add_", 0, s.beta32 * 3),
        Launch(FLA + "chunk_local_cumsum_vector_kernel", 0, s.key32 * 2 + s.index),
    ]
