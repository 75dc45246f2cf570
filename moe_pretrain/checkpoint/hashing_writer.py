"""DCP's file-system writer, hashing every file while it is written: no second pass over the bytes.

Hashing after the save would read every shard file back, a second pass serial after the first. Here every
write() of DCP's writer threads also feeds the file's digest, on data still in memory, so the hashing runs
inside the writer threads (one per file, WRITE_THREADS per rank) and overlaps with their I/O. Files are
written front to back (DCP and torch.save append, never seek), which the digest relies on: the stream offers
no seek, so a writer that needed one would fail, not mis-hash.

A file that fails to write (a full disk mid-write, say) in one of the extra writer threads DCP starts in
write_data would end that thread with its traceback printed (threading's excepthook: a dozen of them, one per
thread and file, around the one line that names the fault) and its results missing, which DCP does not check.
Here such a thread keeps the failure and goes on (its later files fail the same way, quickly), and write_data
raises the first one once its threads are done: DCP reports it as that rank's failure, and the save is not
committed. In the thread that called write_data (and in finish), a failure raises as it comes; the extra threads
that fail after it has raised are silent, the save having failed already.
"""

import hashlib
import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moe_pretrain.checkpoint.storage_full import check_free_space, planned_bytes


class _HashingStream(io.RawIOBase):
    """A write-only file that feeds a SHA-256 digest with every byte it writes."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.digest = hashlib.sha256()
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)  # releases the GIL for large buffers, like the write itself
        written = self._stream.write(view)
        self.written += len(view)
        return written if written is not None else len(view)

    def tell(self) -> int:
        return self.written

    def fileno(self) -> int:
        return self._stream.fileno()

    def flush(self) -> None:
        self._stream.flush()


def with_errno(err: Exception) -> Exception:
    """The OSError with an errno that err arose from, else err. torch's zip writer reports a short write as
    `unexpected pos`, with the ENOSPC beneath it only as its __context__, which DCP loses when it pickles a rank's
    failure for the others (storage_full.py would then have to infer the full disk from the free space)."""
    current: BaseException | None = err
    while current is not None:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__ or current.__context__
    return err


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, dict[str, Any]] = {}
        """File name -> {bytes, sha256} of every file written and closed through this file system."""
        self.failures: list[Exception] = []
        """Why files failed to write in DCP's extra writer threads, in order."""
        self.caller: int | None = None
        """The thread that ran write_data (its own failures raise; so do all before write_data)."""
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                hashing = _HashingStream(stream)
                yield hashing
                hashing.flush()
        except Exception as raised:
            err = with_errno(raised)
            if self.caller in (None, threading.get_ident()):
                if err is raised:
                    raise
                raise err from raised  # the error that has the errno: DCP sends it to the other ranks
            with self._lock:  # one of DCP's extra writer threads: kept, raised by write_data (the docstring says why)
                self.failures.append(err)
            return
        with self._lock:
            self.entries[Path(path).name] = {"bytes": hashing.written, "sha256": hashing.digest.hexdigest()}

    def raise_failure(self) -> None:
        if self.failures:
            raise self.failures[0]


class HashingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter whose `entries` hold the manifest entry of every file it wrote, once written; a save
    whose planned bytes exceed the free space fails before any is written (storage_full.py)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On DCP's coordinator, with every rank's plan: DCP reports a failure here to every rank."""
        check_free_space(Path(self.path), planned_bytes(plans))
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.fs.caller = threading.get_ident()  # kept: the extra threads may still fail after the caller raised
        written = super().write_data(plan, planner)
        self.fs.raise_failure()
        return written

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return self.fs.entries
