"""What this process measures of its memory: the bytes of live tensors (exact, the same on every machine:
what tests bound), and for the benches the allocator's view: resident memory now and at its peak since the
last reset (Linux /proc), and the bytes malloc has handed out.

The resident peak (VmHWM) is what the kernel saw, so it counts every allocation, torch's or not; writing 5
to /proc/self/clear_refs resets it, which lets one process measure the peak of each phase in turn. Both
allocator figures depend on the machine's allocator and load; live tensor bytes do not.
"""

import ctypes
import threading
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{STATUS} has no {field} line")


def resident_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    """The highest resident memory since the process started or reset_peak()."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """Start a new peak from the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not yet had back (glibc mallinfo2: in-use heap + mmapped blocks).

    This is what a GPU caching allocator reports as allocated memory: live tensors, without the freed memory
    the allocator keeps (resident memory includes that slack; measured here at 1.2-2x the live bytes)."""
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise RuntimeError("allocated_bytes needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class AllocatedPeak:
    """The highest allocated_bytes() while the block runs (from `start`, its value at entry), sampled by a
    thread (torch ops release the GIL)."""

    def __init__(self):
        self.start = self.peak = 0

    def __enter__(self) -> "AllocatedPeak":
        self.start = self.peak = allocated_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, allocated_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated_bytes())


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops create inside the block and that are still alive, and their peak.

    Every op's fresh outputs (not the views or in-place results its schema marks as aliases) are counted
    from creation until their storage dies: a storage's Python object lives exactly as long as the storage
    (PyTorch preserves it), so a finalizer on it sees tensors that only autograd still holds. Kernels'
    internal scratch is not seen, and neither is anything created before the block, nor meta tensors (a
    model built on the meta device holds no memory; fake tensors, which stand for a device's, count).
    Deterministic: the same figures on every machine and under any load, unlike the allocator's."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for declared, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
            if declared.alias_info is None:  # a fresh result, not a view or an in-place one
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":  # meta tensors hold no memory
                        self._track(t.untyped_storage())
        return out

    def restart_peak(self) -> None:
        """Measure the next phase's peak from what is alive now."""
        self.peak = self.live

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)
