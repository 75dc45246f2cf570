"""Counting the host reads of tensor values a piece of code makes, and where.

On a GPU every read of a tensor's value on the host (item, tolist, bool / int / float / index of a tensor)
and every op whose output shape depends on the values (nonzero, unique, masked_select, bincount,
boolean-mask indexing, repeat_interleave without output_size) waits for the device's queue to drain: the step stalls
and nothing queued behind it overlaps. On a CPU the same calls are cheap, so they go unnoticed; this
mode counts them on the code path a CUDA run takes, wherever that path runs on a CPU. Counts are of
calls, so they are exact and the same on every machine.
"""

import collections
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__"})
DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount"})
"""Ops whose output's shape depends on the values (bincount: CUDA's reads the maximum to size its output)."""
_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = tuple(str(_ROOT / name) + "/" for name in ("moe_pretrain", "parallel", "gpu_kernels", "launch"))


def _kind(func, args: tuple, kwargs: dict) -> str | None:
    name = getattr(func, "__name__", "")
    if name in HOST_READS or name in DATA_DEPENDENT:
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1 \
            and isinstance(args[1], torch.Tensor):
        return name
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "boolean mask index"
    return None


_READERS = (__file__, str(_ROOT / "moe_pretrain" / "ops" / "host_values.py"))
"""Where reads are made on a caller's behalf (ops/host_values.py's reads are its callers')."""


@functools.cache
def _relative(path: str) -> str:
    """A project file's path from the repository root (cached: the dry run files every op under its site)."""
    return str(Path(path).relative_to(_ROOT))


def project_site(skip: tuple[str, ...] = _READERS) -> str:
    """The innermost caller in the project's packages (file:line) whose file is not one of (or under) `skip`,
    or '?'."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGES) and not path.startswith(skip):
            return f"{_relative(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostReads(TorchFunctionMode):
    """with HostReads() as reads: ... ; reads.total, reads.by_kind, reads.by_site (Counters)."""

    def __init__(self, on_read: Callable[[], None] | None = None):
        """on_read: told of each read as it happens (the estimate's timeline drains its queue there)."""
        super().__init__()
        self.on_read = on_read
        self.by_kind: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def values_read(self) -> int:
        """Reads of a value (item, tolist, bool / int / float / index)."""
        return sum(n for kind, n in self.by_kind.items() if kind in HOST_READS)

    @property
    def shapes_read(self) -> int:
        """Ops whose output shape the host must learn from the values."""
        return self.total - self.values_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.by_kind[kind] += 1
            self.by_site[kind, project_site()] += 1
            if self.on_read is not None:
                self.on_read()
        return func(*args, **kwargs)
