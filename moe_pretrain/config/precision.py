"""The precision and kernels sections: which numerics and which implementations the hot paths use.

Both are run settings, not model settings: a checkpoint written under any of them loads under any other
(weights are always kept in high precision), and each choice has a PyTorch reference it is tested against.
"""

from dataclasses import dataclass
from typing import Literal

from moe_pretrain.config.errors import require


@dataclass
class PrecisionConfig:
    fp8: Literal["off", "tensorwise", "delayed", "blockwise", "mxfp8"] = "off"
    """FP8 for the routed experts' GEMMs, forward and backward (moe_pretrain/fp8/): tensorwise (current
    scaling, e4m3 forward, e5m2 gradients), delayed (scales from an amax history, e4m3 / e5m2), blockwise
    (1x128 activation and 128x128 weight blocks, e4m3 throughout), mxfp8 (1x32 blocks with power-of-two
    scales, e4m3 throughout). Router, norms, nonlinearities and balancing statistics stay in fp32 / bf16.
    A recipe this machine cannot run is refused at start-up."""
    fp8_amax_history: int = 16
    """delayed: the scale of each tensor comes from the largest amax over this many past steps."""

    def __post_init__(self) -> None:
        require(self.fp8_amax_history >= 1, f"precision.fp8_amax_history={self.fp8_amax_history} must be >= 1")


@dataclass
class KernelsConfig:
    triton: Literal["auto", "triton", "torch"] = "auto"
    """Our Triton kernels (gpu_kernels/): fused SiTU-GLU, the AttnRes mix, RMSNorm, KDA's short convolution
    and the MoE permute / unpermute. auto: on CUDA tensors when triton is installed; triton: always (on a CPU
    only under TRITON_INTERPRET=1, for tests); torch: the PyTorch references."""
    grouped_gemm: Literal["auto", "grouped", "loop"] = "auto"
    """The local experts as one torch._grouped_mm (no host sync on the token counts) instead of one matmul
    per expert. auto: where that kernel runs for this device, dtype and widths; grouped: required (start-up
    error otherwise); loop: one matmul per expert (the reference)."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """MLA's document-causal attention. auto: FlexAttention on CUDA (one call per layer over every document,
    gpu_kernels/flex_attention.py), else one SDPA per document (the reference, moe_pretrain/ops/document_attention.py);
    flex: required (a start-up error where its backward cannot run: CPU); sdpa: the reference everywhere."""
    fp8_gemm: Literal["auto", "transformer_engine", "torch"] = "auto"
    """The engine of the FP8 expert GEMMs (precision.fp8). auto: Transformer Engine's grouped GEMM where TE
    imports and runs the recipe on this GPU, else torch's; transformer_engine: required (start-up error
    otherwise); torch: ours (tensorwise / delayed forward as one torch._scaled_grouped_mm on compute
    capability 9.0 / 10.0, else one torch._scaled_mm per expert; blockwise / mxfp8 through the exact CPU
    emulation, refused on a GPU)."""
    kda: Literal["auto", "fla", "torch"] = "auto"
    """KDA's chunked kernel. auto: fla's Triton chunk_kda on CUDA when fla is installed, else the PyTorch chunk
    form (moe_pretrain/ops/kda.py, the reference); fla: required (start-up error otherwise); torch: the
    reference everywhere."""
