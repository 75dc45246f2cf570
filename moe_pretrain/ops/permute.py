"""MoE permute / unpermute: routed copies of tokens into expert order and back (the reference for
gpu_kernels/permute.py, which the ops run with fused=True: Kernels.triton).

Shape legend: T tokens, k experts per token, R = T * k routed copies in expert order, L row width.
token_index [R]: the token each expert-order row copies. positions [T, k]: the expert-order row of copy j
of token t (the inverse map). weights [T, k]: the combine weights of the copies, in the router's dtype.
"""

import torch


def permute(x_TL: torch.Tensor, token_index: torch.Tensor, positions_TK: torch.Tensor, *, fused: bool = False
            ) -> torch.Tensor:
    """[T, L] -> [R, L]: rows[r] = x[token_index[r]]. positions_TK only serves the kernel's backward."""
    if fused:
        from gpu_kernels.permute import permute as kernel

        return kernel(x_TL, token_index, positions_TK)
    return x_TL[token_index]


def unpermute(rows_RL: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor, *, fused: bool = False
              ) -> torch.Tensor:
    """[R, L] -> [T, L]: out[t] = sum_j weights[t, j] rows[positions[t, j]], in the rows' dtype (gradients
    flow to the rows and to the weights, which is how the router learns from the experts' outputs)."""
    if fused:
        from gpu_kernels.permute import unpermute as kernel

        return kernel(rows_RL, positions_TK, weights_TK)
    return (rows_RL[positions_TK] * weights_TK.to(rows_RL.dtype).unsqueeze(-1)).sum(1)
