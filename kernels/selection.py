"""Which implementation each hot op runs, chosen once at start-up from the kernels section.

The ops (moe_pretrain.ops) ask use_triton / the grouped-GEMM rule at call time, so one model code path
serves CPU and GPU: auto picks the fast path where it runs (CUDA), a forced choice that cannot run here is
a start-up error naming its key (never a silent fallback), and tests force either side on a CPU.
"""

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from moe_pretrain.config import ConfigError, KernelsConfig


@dataclass(frozen=True)
class KernelChoice:
    triton: str = "auto"
    grouped_gemm: str = "auto"
    kda: str = "auto"
    attention: str = "auto"


_active = KernelChoice()


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Triton runs kernels on CPU tensors only in its interpreter (read when a kernel is first defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run for tensors on this device; None when they can."""
    if not triton_installed():
        return "triton is not installed"
    if device.type != "cuda" and not triton_interpreted():
        return f"device {device.type} needs TRITON_INTERPRET=1"
    return None


def configure(cfg: KernelsConfig, device: torch.device) -> None:
    """Set the process's choices; a forced fast path that cannot run on this device is a ConfigError."""
    global _active
    if cfg.triton == "triton" and (reason := triton_unavailable_reason(device)):
        raise ConfigError(f"kernels.triton=triton cannot run here: {reason}; use kernels.triton=auto")
    _active = KernelChoice(triton=cfg.triton, grouped_gemm=cfg.grouped_gemm, kda=cfg.kda, attention=cfg.attention)


def active() -> KernelChoice:
    return _active


@contextlib.contextmanager
def choosing(**choices: str) -> Iterator[None]:
    """Temporarily override choices (tests, benches): choosing(triton="triton")."""
    global _active
    saved = _active
    _active = replace(_active, **choices)
    try:
        yield
    finally:
        _active = saved


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on this tensor runs our Triton kernel."""
    if _active.triton == "auto":
        return t.is_cuda and triton_installed()
    return _active.triton == "triton"


def use_flex_attention(t: torch.Tensor) -> bool:
    """Whether MLA's attention over this tensor runs as one FlexAttention call (kernels/flex_attention.py)."""
    if _active.attention == "auto":
        return t.is_cuda
    return _active.attention == "flex"
