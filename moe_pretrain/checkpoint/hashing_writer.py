"""DCP's file-system writer, hashing every file while it is written: no second pass over the bytes.

Hashing after the save would read every shard file back, a second pass serial after the first. Here every
write() of DCP's writer threads also feeds the file's digest, on data still in memory, so the hashing runs
inside the writer threads (one per file, WRITE_THREADS per rank) and overlaps with their I/O. Files are
written front to back (DCP and torch.save append, never seek), which the digest relies on: the stream offers
no seek, so a writer that needed one would fail, not mis-hash.
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
from torch.distributed.checkpoint.planner import SavePlan

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


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, dict[str, Any]] = {}
        """File name -> {bytes, sha256} of every file written and closed through this file system."""
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
            hashing.flush()
        with self._lock:
            self.entries[Path(path).name] = {"bytes": hashing.written, "sha256": hashing.digest.hexdigest()}


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

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return self.fs.entries
