"""Whether a directory takes a write, asked before a run depends on it.

A probe file is written, fsynced and removed: a read-only mount, a missing permission, a stale network mount or a
full disk fails it where a check of the mode bits would pass. The probe is named for its host and process, so every
rank of a job may probe one shared directory at once.
"""

import os
import socket
from pathlib import Path

PROBE_BYTES = 4096
"""One file-system block: enough for a full disk or a quota to refuse it."""


def write_problem(path: Path) -> str | None:
    """None when path is a directory (made if missing) that takes a write; else what is wrong, in a few words."""
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    probe = path / f".write_probe.{socket.gethostname()}.{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as file:
            file.write(b"x" * PROBE_BYTES)
            file.flush()
            os.fsync(file.fileno())
        probe.unlink()
    except OSError as err:
        return f"cannot be written: {err.strerror or err}"
    return None
