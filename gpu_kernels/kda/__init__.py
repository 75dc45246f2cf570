"""KDA fast path: fla's Triton chunk_kda on CUDA; the reference is moe_pretrain.ops.kda's chunk form."""

from gpu_kernels.kda.fla_backend import fla_chunk_kda, fla_unavailable_reason

__all__ = ["fla_chunk_kda", "fla_unavailable_reason"]
