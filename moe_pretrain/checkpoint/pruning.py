"""Deleting old checkpoints without holding up the commit: rename now, delete in the background.

At full size a checkpoint is ~33 TB in many thousands of files on a parallel file system; deleting one
takes minutes, which inside rank 0's commit would stall every rank (and eat the commit's timeout). So
prune() first renames each checkpoint it drops to step_<N>.<tag>.deleting (one metadata operation, atomic:
find() and `latest` can never see a half-deleted checkpoint, because only step_<N> names are ever
candidates), and a background thread deletes the renamed trees. A crash mid-delete leaves only a
.deleting directory, which no resume picks and the next prune sweeps up.
"""

import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from moe_pretrain.checkpoint.directory import DELETING, LATEST, being_deleted, committed_checkpoints
from moe_pretrain.checkpoint.manifest import fsync_dir

log = logging.getLogger(__name__)


class BackgroundDeleter:
    """One thread deleting renamed checkpoint trees in order; each tree is submitted once."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[Path, Future] = {}
        self._lock = threading.Lock()

    def submit(self, path: Path) -> None:
        with self._lock:
            if path in self._pending and not self._pending[path].done():
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-delete")
            self._pending[path] = self._pool.submit(delete_tree, path)

    def wait(self) -> None:
        """Block until every submitted tree is gone (a finished run leaves no .deleting directories)."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for future in pending:
            future.result()


def delete_tree(path: Path) -> None:
    """Remove a renamed checkpoint; a file that cannot be removed is logged, not raised: the tree stays a
    .deleting directory, which nothing reads and the next prune retries."""
    def report(_function: object, name: str, exc_info: tuple) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            log.warning(f"could not delete {name} of pruned checkpoint {path}: {exc_info[1]}")
    shutil.rmtree(path, onerror=report)


DELETER = BackgroundDeleter()
"""The process's deleter (rank 0's; no other rank prunes)."""


def prune(root: Path, keep_last: int, keep_every: int = 0, background: bool = True) -> list[Path]:
    """Drop committed checkpoints beyond the newest keep_last, except multiples of keep_every and the one
    `latest` names (never touched): each is renamed out of the checkpoint namespace at once, then deleted
    (in the background, or before returning with background=False); leftovers of earlier, interrupted
    deletions are deleted too. Returns the checkpoints dropped (their original paths)."""
    latest = root / LATEST
    protected = latest.read_text().strip() if latest.is_file() else None
    dropped = []
    for index, (step, path) in enumerate(committed_checkpoints(root)):
        keep = index < keep_last or (keep_every and step % keep_every == 0) or path.name == protected
        if not keep:
            target = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{DELETING}")
            os.rename(path, target)
            dropped.append(path)
    if dropped:
        fsync_dir(root)  # the renames are durable before anything is deleted
        log.info(f"pruned {', '.join(p.name for p in dropped)} (renamed; deleting "
                 f"{'in the background' if background else 'now'})")
    for path in being_deleted(root):
        if background:
            DELETER.submit(path)
        else:
            delete_tree(path)
    return dropped


def wait_for_deletions() -> None:
    DELETER.wait()
