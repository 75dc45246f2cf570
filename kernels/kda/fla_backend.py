"""Bridge to fla (flash-linear-attention) chunk_kda, imported lazily and used only on CUDA.

fla's Triton kernels do not run on CPU (not even under TRITON_INTERPRET), so the PyTorch chunk form
in moe_pretrain.ops.kda is the reference and the only path exercised on CPU machines. This bridge
has NOT yet been run on a GPU by this project (see README, "GPU paths").
"""

import functools
import importlib.util
import os

import torch


@functools.cache
def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_unavailable_reason(device: torch.device) -> str | None:
    """Why tensors on this device take the PyTorch reference instead of fla's kernel; None when they do not.
    MOE_PRETRAIN_KDA_BACKEND=torch forces the reference."""
    if os.environ.get("MOE_PRETRAIN_KDA_BACKEND", "auto") == "torch":
        return "MOE_PRETRAIN_KDA_BACKEND=torch"
    if device.type != "cuda":
        return f"fla's Triton kernels need CUDA; device {device.type}"
    if not _fla_installed():
        return "fla is not installed: pip install 'moe-pretrain[gpu]'"
    return None


def fla_chunk_kda_supported(q: torch.Tensor) -> bool:
    """True when q lives on CUDA and fla is importable (fla_unavailable_reason's rule)."""
    return fla_unavailable_reason(q.device) is None


def fla_chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, output_final_state):
    """fla.ops.kda.chunk_kda with our argument names; returns (o, final_state or None)."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
