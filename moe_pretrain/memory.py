"""This process's resident memory, now and at its peak since the last reset (Linux /proc; bytes), and the
bytes malloc has allocated (live tensors, no allocator slack), now and at a block's peak.

The peak (VmHWM) is what the kernel saw, so it counts every allocation, torch's or not; writing 5 to
/proc/self/clear_refs resets it, which lets one process measure the peak of each phase in turn.
"""

import ctypes
import threading
from pathlib import Path

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
    """The highest allocated_bytes() while the block runs, sampled by a thread (torch ops release the GIL)."""

    def __enter__(self) -> "AllocatedPeak":
        self.peak = allocated_bytes()
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
