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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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


@dataclass
class Pruned:
    dropped: list[Path] = field(default_factory=list)
    """Checkpoints renamed for deletion (their original paths)."""
    damaged: list[tuple[Path, list[str]]] = field(default_factory=list)
    """Checkpoints kept although they failed `check`, with its problems (never counted, never deleted)."""
    good: int = 0
    """Checkpoints counted toward keep_last (with `check`: those that passed it)."""


def prune(root: Path, keep_last: int, keep_every: int = 0, background: bool = True,
          check: Callable[[Path], list[str]] | None = None) -> Pruned:
    """Drop committed checkpoints beyond the newest keep_last, except multiples of keep_every and the one
    `latest` names (never touched): each is renamed out of the checkpoint namespace at once, then deleted
    (in the background, or before returning with background=False); leftovers of earlier, interrupted
    deletions are deleted too.

    check (a verifier: problems of a checkpoint, [] when intact) makes only checkpoints that pass it count
    toward keep_last: newest first, each is checked until keep_last have passed, and one that fails is kept,
    uncounted, for a person to look at. Only checkpoints older than the keep_last-th good one are dropped, so
    the newest good checkpoint is never deleted, and nothing is when none is good. The trainer prunes right
    after a commit without it: the newest checkpoint is the one it has just written and hashed, and damaged
    ones found at a resume were moved out of the namespace (quarantine.py)."""
    latest = root / LATEST
    protected = latest.read_text().strip() if latest.is_file() else None
    pruned = Pruned()
    for step, path in committed_checkpoints(root):
        if pruned.good < keep_last:
            problems = check(path) if check is not None else []
            if problems:
                pruned.damaged.append((path, problems))
            else:
                pruned.good += 1
            continue
        if (keep_every and step % keep_every == 0) or path.name == protected:
            continue
        target = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{DELETING}")
        os.rename(path, target)
        pruned.dropped.append(path)
    if pruned.dropped:
        fsync_dir(root)  # the renames are durable before anything is deleted
        log.info(f"pruned {', '.join(p.name for p in pruned.dropped)} (renamed; deleting "
                 f"{'in the background' if background else 'now'})")
    for path in being_deleted(root):
        if background:
            DELETER.submit(path)
        else:
            delete_tree(path)
    return pruned


def wait_for_deletions() -> None:
    DELETER.wait()
