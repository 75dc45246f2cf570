"""Whether our Triton kernels can run for tensors on a device (asked once, when the kernels are resolved)."""

import functools
import importlib.util
import os

import torch


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
