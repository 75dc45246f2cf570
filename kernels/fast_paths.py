"""Which GPU fast paths a run on this device uses, and why each one that does not is off.

Said once at start-up (launch/train.py), so a user reading a job log knows whether the expensive
parts ran on fla / Transformer Engine kernels or on the PyTorch reference paths.
"""

import importlib.util

import torch

from kernels.kda import fla_unavailable_reason


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def kda_backend(device: torch.device) -> str:
    """The KDA implementation ops.kda picks for tensors on this device (the rule of kernels/kda)."""
    reason = fla_unavailable_reason(device)
    return f"PyTorch chunk form ({reason})" if reason else "fla chunk_kda (Triton)"


def fast_paths(device: torch.device) -> dict[str, str]:
    """Each fast path's state on this device, in words."""
    te = "installed" if _installed("transformer_engine") else "not installed"
    apex = "importable, unused" if _installed("apex") else "not installed"
    return {
        "KDA": kda_backend(device),
        "FP8": f"off (not implemented yet; Transformer Engine {te})",
        "grouped GEMM": "off (not implemented yet; routed experts run one matmul per expert)",
        "fused kernels": f"torch fused AdamW only (no Triton kernels yet; apex {apex})",
    }


def describe(device: torch.device) -> str:
    return "fast paths: " + "; ".join(f"{name}: {state}" for name, state in fast_paths(device).items())
