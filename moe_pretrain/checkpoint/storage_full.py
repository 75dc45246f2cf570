"""A full file system named as such: checked before a save writes, recognised when a write fails.

A save into a full checkpoint directory used to fail with whatever the lowest writer said (torch's zip writer:
`[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`, its errno lost) with "No space left on
device" only deep in thread tracebacks, and its partial step_<N>.tmp kept the disk full for any retry. Here:
- before any byte is written, DCP's coordinator (rank 0) holds every rank's write plan: their tensor bytes are
  summed and compared with the free space of the checkpoint directory (a shared file system, as multi-node runs
  need), so a save that cannot fit fails at once, naming both figures;
- a write that fails anyway (quotas that statvfs does not show, other writers filling the disk meanwhile) is
  recognised by its errno (ENOSPC, EDQUOT) anywhere in the exception's chain or DCP's per-rank failures, or, when
  no errno survived on the way, by the file system having less than NEARLY_FULL_BYTES free after the failure (an
  errno of another kind, such as EROFS, is that kind however little is free).
store.py then removes the partial directory and raises StorageFullError, which the launcher classes apart
(exit 74, state `storage_full`): a requeue would fail the same way, and an operator must free space.
"""

import errno
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.planner import SavePlan

FULL_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT"}
NEARLY_FULL_BYTES = 64 * 2**20
"""Free space under which a failed write is taken for a full file system even without its errno (a root-reserved
margin or a few partly written blocks can remain when ENOSPC is raised)."""


def size_text(count: int) -> str:
    return f"{count / 1e9:.3f} GB" if count >= 10**8 else f"{count:,} bytes"


def free_bytes(path: Path) -> int:
    """Free space for this user at path (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def planned_bytes(plans: list[SavePlan]) -> int:
    """The tensor bytes every rank's write plan will write (DCP's serialisation adds a little on top)."""
    total = 0
    for plan in plans:
        for item in plan.items:
            if item.tensor_data is not None:
                numel = 1
                for size in item.tensor_data.chunk.sizes:
                    numel *= size
                total += numel * item.tensor_data.properties.dtype.itemsize
    return total


def check_free_space(directory: Path, needed: int) -> None:
    """Raise ENOSPC before writing when `needed` bytes cannot fit in the free space at directory."""
    free = free_bytes(directory)
    if needed > free:
        raise OSError(errno.ENOSPC, f"No space left on device: the save needs {size_text(needed)}, "
                                    f"{size_text(free)} free (checked before writing)", str(directory))


def full_cause(err: BaseException, directory: Path, rank: int) -> str | None:
    """'ENOSPC, <message> (rank r)' when err (or anything it wraps) is a full file system or quota, else None;
    r is the rank the error arose on (DCP hands one rank's failure to all). When no errno survives, a file
    system left with under NEARLY_FULL_BYTES free counts as full."""
    seen, stack, other_errno = set(), [(err, rank)], False
    while stack:
        current, origin = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_ERRNOS:
            where = f" at {current.filename}" if current.filename else ""
            message = current.strerror or os.strerror(current.errno)
            return f"{FULL_ERRNOS[current.errno]}, {message}{where} (rank {origin})"
        other_errno |= isinstance(current, OSError) and current.errno is not None
        failures = getattr(current, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack += [(cause[0] if isinstance(cause, tuple) else cause, failed) for failed, cause in failures.items()]
        stack += [(current.__cause__, origin), (current.__context__, origin)]
    if other_errno:  # the errno says what it was (read-only, no permission): not a full disk, however little is free
        return None
    free = free_bytes(directory)
    if free < NEARLY_FULL_BYTES:
        said = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""  # DCP's add their tracebacks
        return (f"ENOSPC inferred: {type(err).__name__}: {said}, with {size_text(free)} left free on "
                f"the file system (rank {rank})")
    return None
