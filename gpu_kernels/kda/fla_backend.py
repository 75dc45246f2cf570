"""Bridge to fla (flash-linear-attention) chunk_kda, imported lazily; a model takes it where Kernels.kda says fla.

fla's Triton kernels do not run on CPU (not even under TRITON_INTERPRET), so the PyTorch chunk form
in moe_pretrain.ops.kda is the reference and the only path exercised on CPU machines. tests/gpu/test_fla_kda.py
compares the two on a GPU (bench/gpu_check.sh); see docs/gpu.md, for whether that has run yet.
Context parallelism (cp > 1) runs KDA through parallel/context_parallel.py's own chunk form, not fla.
"""

import functools
import importlib.util

import torch


@functools.cache
def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


SAFE_GATE_RANGE = (-5.0, 0.0)
"""fla's safe-gate path is exact for bounded gates g >= lower_bound with lower_bound in [-5, 0) only (its
kernels' own checks; beyond -5 the per-chunk decay products leave the range its fp32 tiles are sized for)."""


def safe_gate_reason(lower_bound: float | None) -> str | None:
    """Why fla's safe gate cannot take this bounded gate's floor (None: it can, or the gate is unbounded)."""
    low, high = SAFE_GATE_RANGE
    if lower_bound is None or low <= lower_bound < high:
        return None
    return f"fla's safe gate takes model.kda.lower_bound in [{low:g}, {high:g}), not {lower_bound:g}"


MIN_HEAD_DIM = 16
"""fla's chunk_kda tiles the key dimension into tl.dot operands, which take 16 or more along their inner
dimension: a narrower head fails to compile on the GPU."""


def fla_unavailable_reason(device: torch.device, lower_bound: float | None = None,
                           head_dim: int = MIN_HEAD_DIM) -> str | None:
    """Why fla's kernel cannot run for tensors on this device with this gate floor (None: the softplus
    gate) and KDA head width; None when it can."""
    if reason := safe_gate_reason(lower_bound):  # a config fault on any machine: said first
        return reason
    if device.type != "cuda":
        return f"fla's Triton kernels need CUDA; device {device.type}"
    if not _fla_installed():
        return "fla is not installed: pip install 'moe-pretrain[gpu]'"
    if head_dim < MIN_HEAD_DIM:
        return f"fla's chunk_kda takes model.kda.head_dim >= {MIN_HEAD_DIM} (its tl.dot tiles), not {head_dim}"
    return None


def fla_chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, output_final_state, lower_bound=None):
    """fla.ops.kda.chunk_kda with our argument names; returns (o, final_state or None). lower_bound (the
    bounded gate's floor, g >= lower_bound) turns on fla's safe-gate path; the gate itself stays ours
    (use_gate_in_kernel=False: g arrives computed, as the reference takes it)."""
    from fla.ops.kda import chunk_kda

    if reason := safe_gate_reason(lower_bound):
        raise ValueError(reason)
    safe_gate = {} if lower_bound is None else {"safe_gate": True, "lower_bound": lower_bound}
    return chunk_kda(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),  # fla takes int64 offsets
        **safe_gate,
    )
