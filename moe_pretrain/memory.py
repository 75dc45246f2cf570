"""This process's resident memory, now and at its peak since the last reset (Linux /proc; bytes).

The peak (VmHWM) is what the kernel saw, so it counts every allocation, torch's or not; writing 5 to
/proc/self/clear_refs resets it, which lets one process measure the peak of each phase in turn.
"""

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
