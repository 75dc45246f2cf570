"""Whether fla's (flash-linear-attention) chunk KDA can run here; a model takes it where Kernels.kda says fla.

fla's Triton kernels run on CUDA, and on a CPU under Triton's interpreter (TRITON_INTERPRET=1) once each
autotuned kernel reads a pinned config (gpu_kernels/kda/fla_configs/) and four gaps of the interpreter are
shimmed: the tests do both (tests/conftest.py, tests/fla_interpreter.py) and compare fla's path with the PyTorch
chunk form of moe_pretrain.ops.kda, the reference, there (tests/unit/test_fla_cpu.py); on a GPU
tests/gpu/test_fla_kda.py does (bench/gpu_check.sh; docs/gpu.md says whether that has run yet). auto keeps the
reference on a CPU: only kernels.kda=fla asks for fla there.
Context parallelism (cp > 1) runs KDA through parallel/context_parallel.py's own chunk form, not fla. The
custom ops that call fla are in gpu_kernels/kda/fla_ops.py.
"""

import functools
import importlib.util

import torch

from gpu_kernels.triton_support import triton_interpreted


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


CHUNK_SIZES = (32, 64)
"""The chunks fla's KDA kernels are written for."""
MIN_HEAD_DIM = 16
"""fla's chunk_kda tiles the key dimension into tl.dot operands, which take 16 or more along their inner
dimension: a narrower head fails to compile on the GPU."""


def fla_config_reason(lower_bound: float | None = None, head_dim: int = MIN_HEAD_DIM, chunk_size: int = 64
                      ) -> str | None:
    """Why fla's kernel cannot take this gate floor (None: the softplus gate), KDA head width and chunk on any
    device (a dry run's question); None when it can."""
    if reason := safe_gate_reason(lower_bound):
        return reason
    if head_dim < MIN_HEAD_DIM:
        return f"fla's chunk_kda takes model.kda.head_dim >= {MIN_HEAD_DIM} (its tl.dot tiles), not {head_dim}"
    if chunk_size not in CHUNK_SIZES:
        return f"fla's chunk_kda takes model.kda.chunk_size in {CHUNK_SIZES}, not {chunk_size}"
    return None


def fla_unavailable_reason(device: torch.device, lower_bound: float | None = None,
                           head_dim: int = MIN_HEAD_DIM, chunk_size: int = 64) -> str | None:
    """Why fla's kernel cannot run for tensors on this device with this gate floor, KDA head width and chunk;
    None when it can."""
    if reason := safe_gate_reason(lower_bound):  # a config fault on any machine: said first
        return reason
    if device.type != "cuda" and not triton_interpreted():
        return f"fla's Triton kernels need CUDA (or TRITON_INTERPRET=1 and pinned configs); device {device.type}"
    if not _fla_installed():
        return "fla is not installed: pip install 'moe-pretrain[gpu]'"
    return fla_config_reason(lower_bound, head_dim, chunk_size)
