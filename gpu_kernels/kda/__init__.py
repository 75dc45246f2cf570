"""KDA fast path: fla's Triton chunk_kda on CUDA; the reference is moe_pretrain.ops.kda's chunk form."""

from gpu_kernels.kda import fla_launches  # noqa: F401  (registers the ops' launches with the op census)
from gpu_kernels.kda.fla_backend import fla_unavailable_reason
from gpu_kernels.kda.fla_ops import fla_chunk_kda

__all__ = ["fla_chunk_kda", "fla_unavailable_reason"]
