"""The manifest that makes a checkpoint directory trustworthy: every file's size and SHA-256.

Written last, after all ranks succeeded; a directory without a valid manifest is not a checkpoint.
The work scales out: each rank hashes the files it writes while writing them (hashing_writer.py,
rank_entries), rank 0 only merges
those entries and hashes what is left (its own small JSON files), and verification is split the same
way (verify(..., share=(rank, world))), so neither grows with the number of ranks on any one rank.
"""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
VERIFY_THREADS = 4
"""Files one rank reads and hashes at once when verifying."""
FORMAT_VERSION = 1


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_durably(path: Path, text: str) -> None:
    """Write a small file through a temporary name: fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_entry(path: Path) -> dict[str, Any]:
    """fsync a written file, then its manifest entry: size and SHA-256."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def rank_files(directory: Path, rank: int) -> list[str]:
    """The files DCP's FileSystemWriter wrote for this rank: __<rank>_<i>.distcp (the coordinator's .metadata
    is rank 0's to hash at commit, with the other files rank 0 writes)."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*") if p.is_file())


def rank_entries(directory: Path, rank: int, written: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """This rank's manifest entries, name -> {bytes, sha256}, from the digests taken while writing
    (`written`); each checked against the file on disk, so a file the writer did not hash is never listed."""
    entries = {}
    for name in rank_files(directory, rank):
        entry = written.get(name)
        size = (directory / name).stat().st_size
        if entry is None or entry["bytes"] != size:
            raise OSError(f"{directory / name}: {size} bytes on disk, but the writer hashed "
                          f"{'nothing' if entry is None else entry['bytes']}")
        entries[name] = entry
    return entries


def write_manifest(directory: Path, info: dict[str, Any], entries: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """Seal a directory: `entries` are the files other ranks hashed; every other file is hashed here."""
    files = dict(entries or {})
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = str(path.relative_to(directory))
        if name not in files:
            files[name] = file_entry(path)
    manifest = {"format": FORMAT_VERSION, **info, "files": dict(sorted(files.items()))}
    write_durably(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    with (directory / MANIFEST).open() as f:
        return json.load(f)


def _share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[tuple[str, dict[str, Any]]]:
    """The files rank checks of world: largest first, each to the share with the fewest bytes so far (the
    same deterministic split on every rank), so every share reads about total / world bytes."""
    loads = [0] * world
    mine = []
    for name, entry in sorted(files.items(), key=lambda item: (-item[1]["bytes"], item[0])):
        owner = loads.index(min(loads))
        loads[owner] += entry["bytes"]
        if owner == rank:
            mine.append((name, entry))
    return mine


def verify(directory: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Every problem with a checkpoint directory, each naming the file; [] when it is complete and intact.
    share=(rank, world) checks only that rank's share of the listed files (the manifest itself is checked by
    every share): the union of all shares' problems is the whole directory's."""
    if not (directory / MANIFEST).is_file():
        return [f"{directory / MANIFEST}: missing (the save never committed)"]
    try:
        manifest = read_manifest(directory)
    except (OSError, json.JSONDecodeError) as err:
        return [f"{directory / MANIFEST}: unreadable ({err})"]
    problems = []
    if ".metadata" not in manifest.get("files", {}):
        problems.append(f"{directory / '.metadata'}: not listed in the manifest")
    share_files = _share(manifest.get("files", {}), *share)
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="verify") as pool:
        # SHA-256 releases the GIL: a rank's files are read and hashed VERIFY_THREADS at a time.
        for problem in pool.map(lambda item: _check_file(directory / item[0], item[1]), share_files):
            problems += problem
    return problems


def _check_file(path: Path, expected: dict[str, Any]) -> list[str]:
    if not path.is_file():
        return [f"{path}: missing"]
    size = path.stat().st_size
    if size != expected["bytes"]:
        return [f"{path}: {size} bytes, expected {expected['bytes']}"]
    found = sha256(path)
    if found != expected["sha256"]:
        return [f"{path}: sha256 {found}, expected {expected['sha256']}"]
    return []
