"""Which fast paths a run uses on its device: checked and set once at start-up, then reported.

configure() turns the kernels and precision sections into the process's choices and refuses, naming the
key, any forced fast path or FP8 recipe this machine cannot run (never a silent fallback). fast_paths()
says, in words, what each hot path runs on, so a user reading a job log knows whether the expensive parts
ran on fla / Triton / grouped-GEMM / FP8 kernels or on the PyTorch references.
"""

import torch

from kernels import selection
from kernels.flex_attention import flex_unavailable_reason
from kernels.kda import fla_unavailable_reason
from moe_pretrain.config import Config, ConfigError
from moe_pretrain.fp8 import fp8_unavailable_reason
from moe_pretrain.fp8.recipes import describe as describe_fp8
from moe_pretrain.ops.grouped_mm import grouped_kernel_unavailable_reason


def grouped_gemm_reason(cfg: Config, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the routed experts' GEMMs (in and out of the latent width, in the compute dtype) cannot run as
    torch._grouped_mm."""
    moe = cfg.model.moe
    return grouped_kernel_unavailable_reason(device, dtype, moe.latent_size, moe.expert_intermediate)


def kda_gate_floor(cfg: Config) -> float | None:
    """The KDA decay's floor fla's safe gate is given (the bounded form's), None for the softplus form."""
    return cfg.model.kda.lower_bound if cfg.model.kda.gate == "lower_bound" else None


def configure(cfg: Config, device: torch.device, dtype: torch.dtype) -> None:
    """Validate the forced choices for this device and compute dtype (train.dtype's) and make them the
    process's (kernels.selection)."""
    if cfg.kernels.grouped_gemm == "grouped" and (reason := grouped_gemm_reason(cfg, device, dtype)):
        raise ConfigError(f"kernels.grouped_gemm=grouped cannot run here: {reason}; use kernels.grouped_gemm=auto")
    if cfg.kernels.attention == "flex" and (reason := flex_unavailable_reason(device, training=True)):
        raise ConfigError(f"kernels.attention=flex cannot run here: {reason}; use kernels.attention=auto")
    if cfg.kernels.kda == "fla" and (reason := fla_unavailable_reason(device, kda_gate_floor(cfg))):
        raise ConfigError(f"kernels.kda=fla cannot run here: {reason}; use kernels.kda=auto")
    if cfg.precision.fp8 != "off" and (reason := fp8_unavailable_reason(cfg.precision.fp8, device)):
        raise ConfigError(f"precision.fp8={cfg.precision.fp8} cannot run on {device}: {reason}")
    selection.configure(cfg.kernels, device)


def fast_paths(cfg: Config, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Each fast path's state for this run on this device, in words."""
    kda_reason = ("kernels.kda=torch" if cfg.kernels.kda == "torch"
                  else fla_unavailable_reason(device, kda_gate_floor(cfg)))
    triton_reason = selection.triton_unavailable_reason(device)
    if cfg.kernels.triton == "torch":
        triton = "off (kernels.triton=torch): PyTorch references"
    elif triton_reason is None and (cfg.kernels.triton == "triton" or device.type == "cuda"):
        triton = "on"
    else:
        triton = f"off ({triton_reason or 'auto takes them on CUDA only'}): PyTorch references"
    grouped_reason = grouped_gemm_reason(cfg, device, dtype)
    grouped = ("off (kernels.grouped_gemm=loop): one matmul per expert" if cfg.kernels.grouped_gemm == "loop"
               else f"off ({grouped_reason}): one matmul per expert" if grouped_reason
               else "torch._grouped_mm, forward and backward")
    if cfg.precision.fp8 != "off":
        grouped = f"{grouped} (unused by the FP8 expert GEMMs, which loop over experts)"
    flex_reason = ("kernels.attention=sdpa" if cfg.kernels.attention == "sdpa"
                   else flex_unavailable_reason(device, training=True))
    return {
        "KDA": f"PyTorch chunk form ({kda_reason})" if kda_reason else "fla chunk_kda (Triton)",
        "MLA attention": (f"one SDPA per document ({flex_reason})" if flex_reason
                          else "FlexAttention, one call per layer"),
        "FP8": describe_fp8(cfg.precision.fp8, device),
        "grouped GEMM": grouped,
        "Triton kernels (SiTU-GLU, MoE permute)": triton,
    }


def describe(cfg: Config, device: torch.device, dtype: torch.dtype) -> str:
    return "fast paths: " + "; ".join(f"{name}: {state}" for name, state in fast_paths(cfg, device, dtype).items())
