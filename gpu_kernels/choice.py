"""Which implementation each hot op of one model runs, fixed when the model is built.

A Kernels value travels into the module tree at construction (MoETransformer(cfg, kernels)): every module
keeps the choices it uses and passes them to its ops as arguments, so a forward never consults
process-wide state, two models with different choices live in one process, and the start-up report reads
the choices from the built modules (gpu_kernels/fast_paths.py). The defaults are the PyTorch references (the
grouped GEMM's `auto` asks the operands, see ops/grouped_mm.py); gpu_kernels/fast_paths.resolve turns a run's
kernels and precision sections into the choices its device can run, refusing a forced one it cannot.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from moe_pretrain.ops.host_values import READ, HostValues

if TYPE_CHECKING:
    from moe_pretrain.fp8.settings import Fp8Settings


@dataclass(frozen=True)
class Kernels:
    triton: bool = False
    """SiTU-GLU, the AttnRes mix, RMSNorm, KDA's short convolution and the MoE permute / unpermute
    through our Triton kernels (gpu_kernels/situ_glu.py, attn_res.py, rms_norm.py, short_conv.py, permute.py)."""
    grouped_gemm: Literal["auto", "grouped", "loop"] = "auto"
    """The routed experts' GEMMs: one torch._grouped_mm, one matmul per expert, or (auto) whichever the
    operands' device, dtype and widths allow (ops/grouped_mm.py)."""
    kda: Literal["fla", "torch"] = "torch"
    """KDA's chunked recurrence: fla's Triton chunk_kda, or the PyTorch chunk form (ops/kda.py)."""
    attention: Literal["flex", "sdpa"] = "sdpa"
    """MLA's document-causal attention: one FlexAttention call per layer, or one SDPA per document."""
    fp8: "Fp8Settings | None" = None
    """The routed experts' FP8 recipe and GEMM engine (precision.fp8, kernels.fp8_gemm); None: compute dtype."""
    host: HostValues = field(default=READ, compare=False)
    """How the modules read device values on the host: a real run's reads, or the dry run's assumed ones
    (ops/host_values.py)."""
    why_not: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """(path, reason) for each fast path resolve() left on its reference: what the start-up report says."""

    def reason(self, path: str) -> str | None:
        return dict(self.why_not).get(path)


REFERENCES = Kernels()
"""The PyTorch references everywhere: what a module is built with when no run resolved its kernels."""
