"""Saving, finding and loading checkpoints: <dir>/step_<N>/, committed atomically, with <dir>/latest.

Save: every rank writes its DCP shard files into step_<N>.tmp (never overwriting), fsyncing them and hashing
every byte as it writes it (in parallel with every other rank; for async saves in the background); success and
the hash entries are gathered over all ranks; only then rank 0 writes trainer_state.json and the manifest
(merging the entries, hashing only its own JSON), renames the directory to step_<N>, and replaces `latest`
durably. Any failure anywhere leaves `latest` untouched and raises on every rank. A .tmp directory is never
a checkpoint.
Load: resume=auto takes the newest directory whose manifest verifies, saying plainly why it skipped
any newer one and moving those aside (quarantine.py); a checkpoint of another model is refused before
anything is verified or moved (fit.py); tensors come back through DCP (no pickles), other state from JSON.

`group`: the process group for every collective here and DCP's. Their waits last as long as the slowest
rank's I/O, so the trainer gives them a group whose timeout grows with the state each rank holds
(checkpoint_timeout); None = the default group.
"""

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

from moe_pretrain.checkpoint.directory import LATEST, committed_checkpoints, step_dir
from moe_pretrain.checkpoint.hashing_writer import HashingFileSystemWriter
from moe_pretrain.checkpoint.manifest import (
    fsync_dir,
    rank_entries,
    read_manifest,
    verify,
    write_durably,
    write_manifest,
)
from moe_pretrain.checkpoint.pruning import prune
from moe_pretrain.checkpoint.quarantine import point_latest, quarantine
from moe_pretrain.checkpoint.staging import ReusedHostStager
from moe_pretrain.checkpoint.storage_full import full_cause
from parallel.collectives import all_reduce_max, barrier, gather_objects
from parallel.flat_shards import BoxedLoadPlanner, BoxedSavePlanner, BoxedTensor

log = logging.getLogger(__name__)

WRITE_THREADS = 4
"""Files (and writer threads) per rank and save: parallel writes, and hashing that can start per file."""
TRAINER_STATE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or rank."""


class StorageFullError(CheckpointError):
    """A save failed because the checkpoint's file system or quota is full (storage_full.py); the partial
    directory was removed and the previous checkpoint is intact."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint was saved by another model or optimizer than this run's (fit.py names the keys). Not
    a fault of the run: nothing is moved aside, and the launcher leaves the run's status.json as it was."""


def _describe(err: BaseException, rank: int) -> list[str]:
    """'rank r: Type: message' lines. DCP's CheckpointException (a BaseException) already carries every
    failing rank's (exception, traceback); it is unwrapped so the message names the rank of origin."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        lines = []
        for failed_rank, cause in sorted(failures.items()):
            exc = cause[0] if isinstance(cause, tuple) else cause
            lines.append(f"rank {failed_rank}: {_said(exc)}{_optimizer_hint(exc)}")
        return lines
    return [f"rank {rank}: {_said(err)}{_optimizer_hint(err)}"]


def _said(err: BaseException) -> str:
    """'Type: message', or what an error without a message means (an EOFError: a file ends before its data)."""
    if str(err):
        return f"{type(err).__name__}: {err}"
    return f"{type(err).__name__}" + (" (a file ends before its data)" if isinstance(err, EOFError) else
                                      " (without a message)")


def _optimizer_hint(err: BaseException) -> str:
    """What a missing optimizer moment means: AdamW keeps exp_avg / exp_avg_sq, Muon momentum, per parameter."""
    missing = "Missing key in checkpoint state_dict: optim."
    return (" (the checkpoint holds another optimizer's state: was it saved with another optim.name?)"
            if missing in str(err) else "")


Entries = dict[str, dict[str, Any]]
"""Manifest entries of files one rank hashed: name -> {bytes, sha256}."""


def checkpoint_timeout(base_s: float, state_bytes: int, floor_bytes_per_s: float) -> timedelta:
    """The limit for a collective that waits on checkpoint I/O: the usual process-group timeout plus the time
    the largest rank's state takes at the slowest storage rate planned for, for each of the three passes
    over it (write, hash; at resume, verify)."""
    return timedelta(seconds=base_s + 3 * state_bytes / floor_bytes_per_s)


def _gather(report: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's report, in rank order, on every rank (group None: the default group, if any)."""
    return gather_objects(report, group or (dist.group.WORLD if dist.is_initialized() else None))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        barrier(group or dist.group.WORLD)


def _prepare(root: Path, step: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # the partial remains of an earlier, failed save of this step
            shutil.rmtree(tmp)
    _barrier(group)
    if final.exists():
        raise CheckpointError(f"{final} already exists; a checkpoint is never overwritten")
    return final, tmp


def _writer(tmp: Path, file_per_item: bool = False) -> HashingFileSystemWriter:
    """DCP's writer: WRITE_THREADS files per rank (or one per tensor piece: DCP's writer holds a file's
    tensors until the file is closed), each fsync'd and hashed as it is written."""
    return HashingFileSystemWriter(tmp, thread_count=WRITE_THREADS, overwrite=False, sync_files=True,
                                   single_file_per_rank=not file_per_item)


@dataclass
class WriteReport:
    """One rank's outcome of writing its share of a save."""

    failures: list[str]
    entries: Entries
    full: str | None = None
    """The full file system's errno and message when that is why the write failed (storage_full.py)."""


def _written_and_hashed(tmp: Path, write: Any, writer: HashingFileSystemWriter) -> WriteReport:
    """Run `write` (DCP's save, or waiting on its future); then this rank's files' entries, hashed by
    `writer` as it wrote them."""
    try:
        write()
        return WriteReport([], rank_entries(tmp, _rank(), writer.entries))
    except (Exception, DCPCheckpointException) as err:  # every rank must learn of any rank's failure
        return WriteReport(_describe(err, _rank()), {}, full_cause(err, tmp, _rank()))


def _commit(root: Path, final: Path, report: WriteReport, trainer_state: dict[str, Any],
            info: dict[str, Any], keep_last: int, keep_every: int, group: dist.ProcessGroup | None) -> Path:
    """Gather every rank's report; if none failed, rank 0 merges the hash entries into the manifest, seals the
    directory and moves `latest` to it. If any failed, rank 0 removes the partial directory (nothing in it is
    ever read, and on a full disk it holds the space a retry needs) and every rank raises."""
    reports = _gather(report, group)
    tmp = final.with_name(final.name + ".tmp")
    failures = sorted({line for r in reports for line in r.failures})
    if failures:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        full = next((r.full for r in reports if r.full), None)
        if full:
            latest = root / LATEST
            kept = (f"the last checkpoint, {latest.read_text().strip()}, is intact" if latest.is_file()
                    else "no checkpoint was committed before it")
            raise StorageFullError(
                f"checkpoint.dir={root} is full: {full}. {final.name} was not saved and its partial {tmp.name} "
                f"removed; {kept}. Free space or move checkpoint.dir, then relaunch")
        raise CheckpointError(f"checkpoint {final} not committed (its partial {tmp.name} was removed): "
                              + "; ".join(failures))
    if _rank() == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
        write_manifest(tmp, {"step": trainer_state["step"], **info},
                       {name: entry for r in reports for name, entry in r.entries.items()})
        tmp.rename(final)
        fsync_dir(root)
        write_durably(root / LATEST, final.name + "\n")
        log.info(f"checkpoint: committed {final} (step {trainer_state['step']})")
        prune(root, keep_last, keep_every)  # renames now, deletes in the background (pruning.py)
    _barrier(group)
    return final


def save(root: Path, step: int, tensors: dict[str, torch.Tensor | BoxedTensor], trainer_state: dict[str, Any],
         info: dict[str, Any], keep_last: int, keep_every: int, group: dist.ProcessGroup | None = None,
         planner: BoxedSavePlanner | None = None, file_per_item: bool = False) -> Path:
    """Synchronous save: write and hash (every rank its own files), gather, commit. `planner`: one that
    produces tensors as they are written (the importer's); file_per_item bounds the memory that takes."""
    final, tmp = _prepare(root, step, group)
    writer = _writer(tmp, file_per_item)

    def write() -> None:
        dcp.save(tensors, storage_writer=writer, planner=planner or BoxedSavePlanner(), process_group=group)
    report = _written_and_hashed(tmp, write, writer)
    return _commit(root, final, report, trainer_state, info, keep_last, keep_every, group)


class AsyncSaver:
    """Background saves: the training never waits for the files, and for the host copy only if its next
    update comes before the copy is done.

    start() returns at once; a thread of ours copies the tensors into host buffers (staging.py), then writes
    them with DCP over `write_group`, hashing every file as it is written. Both groups are gloo groups of
    their own: the training's collectives never interleave with the checkpoint's, and the background
    write's (DCP's plan and result gathers, on that thread) never with poll's and the commit's on the
    training thread. Over one group the two threads' collectives would pair up across ranks in whatever
    order each rank's threads reached them: a rank whose write ended early (a failed disk) polled while
    another was still gathering, and both hung. The copy overlaps the next step's forward and backward, which only
    read the parameters; before_update() is called before anything changes them (the optimizer step, the
    balancing biases) and waits for the copy, as torchtitan's async staging does. At most one save is in
    flight. poll() is called once per step on every rank: an all-reduce agrees on whether every rank has
    finished writing and hashing, and only then the save is gathered and committed, so a background
    failure surfaces on every rank at the next step and the checkpoint is not committed.
    """

    def __init__(self, group: dist.ProcessGroup | None, write_group: dist.ProcessGroup | None = None):
        """group: poll and commit (the training thread); write_group: the background writes (one process:
        both None)."""
        self.group, self.write_group = group, write_group
        self.pending: tuple | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._stager = ReusedHostStager()
        self._staged = threading.Event()
        self._staged.set()
        self.staging_wait_s = 0.0
        """Seconds the last before_update() waited for the copy."""

    def start(self, root: Path, step: int, tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any],
              info: dict[str, Any], keep_last: int, keep_every: int) -> None:
        self.wait()
        final, tmp = _prepare(root, step, self.group)
        writer = _writer(tmp)
        self._staged.clear()
        ready = self._stager.ready_event(tensors)  # on this (the training's) thread: after the step's writes

        def write() -> None:
            try:
                staged = self._stager.stage(tensors, after=ready)
            finally:
                self._staged.set()
            dcp.save(staged, storage_writer=writer, planner=BoxedSavePlanner(), process_group=self.write_group)
        hashed: Future = self._worker.submit(_written_and_hashed, tmp, write, writer)
        self.pending = (hashed, root, final, trainer_state, info, keep_last, keep_every)

    def before_update(self) -> None:
        """Wait until the pending save's host copy is taken: call before the state changes."""
        start = time.perf_counter()
        self._staged.wait()
        self.staging_wait_s = time.perf_counter() - start

    def poll(self) -> Path | None:
        """Commit the pending save if every rank has finished writing it (collective)."""
        if self.pending is None:
            return None
        # Over the checkpoint group (gloo: a host flag, whatever the training backend).
        group = self.group or (dist.group.WORLD if dist.is_initialized() else None)
        writing = all_reduce_max(torch.tensor([int(not self.pending[0].done())]), group)
        return None if writing.item() else self._finish()

    def wait(self) -> Path | None:
        """Block until the pending save is written, then commit it (collective)."""
        return self._finish() if self.pending is not None else None

    def _finish(self) -> Path:
        hashed, root, final, trainer_state, info, keep_last, keep_every = self.pending
        self.pending = None
        return _commit(root, final, hashed.result(), trainer_state, info, keep_last, keep_every, self.group)


def shared_verify(group: dist.ProcessGroup | None = None) -> Callable[[Path], list[str]]:
    """verify() split over the ranks: each checks its share of the files, the problems are gathered, and
    every rank gets the same list (one process: the whole directory)."""
    if not dist.is_initialized():
        return verify

    def verify_on_every_rank(path: Path) -> list[str]:
        mine = verify(path, share=(dist.get_rank(group), dist.get_world_size(group)))
        return sorted({line for lines in _gather(mine, group) for line in lines})
    return verify_on_every_rank


def verifying_load(load: Callable[[Path], object], group: dist.ProcessGroup | None = None
                   ) -> Callable[[Path], list[str]]:
    """A find() verifier that also loads, in one pass over the storage instead of two: each rank hashes its
    share of the files in a background thread while load(path) reads the checkpoint; the problems of both are
    gathered, so every rank agrees. find() then returns the first candidate without problems, already loaded;
    one with damaged files is loaded over by the next. A checkpoint whose every file verifies but which does
    not load is not damage (another model's, a failing read): CheckpointMismatchError on every rank, so that
    resume=auto never moves an intact checkpoint aside."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)

    def verify_while_loading(path: Path) -> list[str]:
        with ThreadPoolExecutor(1, thread_name_prefix="verify") as pool:
            hashing = pool.submit(verify, path, (rank, world))
            try:
                load(path)
                failed = []
            except (Exception, DCPCheckpointException) as err:  # every rank must learn of any rank's failure
                failed = [f"{path}: does not load ({'; '.join(_describe(err, rank))})"]
            mine = (hashing.result(), failed)
        reports = _gather(mine, group)
        damage = sorted({line for lines, _ in reports for line in lines})
        failures = sorted({line for _, lines in reports for line in lines})
        if failures and not damage:
            raise CheckpointMismatchError(f"every file of {path} verifies, but it does not load into this run: "
                                          + "; ".join(failures))
        return damage + failures
    return verify_while_loading


def find(root: Path, resume: str, verifier: Callable[[Path], list[str]] = verify,
         check_fit: Callable[[Path], None] | None = None, set_aside: bool = False) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (or None) and the warnings about newer ones that failed verification (rank
    0 also logs each as it is found).
    With shared_verify() as verifier every rank must call it, and all get the same answer. check_fit(path)
    raises before a candidate is verified when it belongs to another model (fit.py). set_aside: once a good
    checkpoint is found under resume=auto, rank 0 moves each newer, damaged one aside and points `latest` at
    the good one (quarantine.py); nothing is moved when none verifies or one does not fit."""
    if resume == "none":
        return None, []
    if resume != "auto":
        path = Path(resume)
        if check_fit is not None and path.is_dir():
            check_fit(path)
        problems = verifier(path) if path.is_dir() else [f"{path}: no such checkpoint directory"]
        if problems:
            raise CheckpointError(f"train.resume={resume} cannot be loaded: " + "; ".join(problems))
        return path, []
    warnings, damaged = [], []
    for _, path in committed_checkpoints(root):
        if check_fit is not None:
            check_fit(path)
        problems = verifier(path)
        if not problems:
            if set_aside and _rank() == 0:
                for bad, why in damaged:
                    quarantine(bad, why, path)
                point_latest(root, path)
            return path, warnings
        damaged.append((path, problems))
        warnings.append(f"skipping {path}: " + "; ".join(problems))
        if _rank() == 0:
            log.warning(f"checkpoint: {warnings[-1]}")
    if warnings:
        # Starting from scratch would silently throw the run away, and a restart would do it again.
        raise CheckpointError(f"no checkpoint in {root} verifies ({'; '.join(warnings)}); not starting over. "
                              "Repair or move them aside, or set train.resume=none to start a new run")
    return None, warnings


def load(path: Path, tensors: dict[str, torch.Tensor | BoxedTensor], group: dist.ProcessGroup | None = None
         ) -> dict[str, Any]:
    """Fill `tensors` in place from the checkpoint (resharding as needed); return the trainer state."""
    dcp.load(tensors, storage_reader=FileSystemReader(path), planner=BoxedLoadPlanner(), process_group=group)
    return read_trainer_state(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON state: step, tokens, data position, RNG states and the resolved config."""
    return json.loads((path / TRAINER_STATE).read_text())


def describe(path: Path) -> dict[str, Any]:
    return read_manifest(path)
