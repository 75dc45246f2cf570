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


TILE_ELEMENTS = 4096
"""A row kernel's tile, rows x width, at most (rounded up to one row)."""


def row_tiles(width: int) -> tuple[int, int]:
    """(BLOCK, ROWS) of a kernel that works on whole rows: the width rounded up to a power of two, and the rows a
    program takes at once: one at the model's widths (a row of thousands fills a program), several for narrow
    rows (the interpreter runs a program at a time: tests)."""
    import triton

    block = triton.next_power_of_2(width)
    return block, max(1, min(64, TILE_ELEMENTS // block))
