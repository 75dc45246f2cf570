"""The manifest that makes a checkpoint directory trustworthy: every file's size and SHA-256.

Written last, after all ranks succeeded; a directory without a valid manifest is not a checkpoint.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
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


def write_manifest(directory: Path, info: dict[str, Any]) -> dict[str, Any]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(directory))] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    manifest = {"format": FORMAT_VERSION, **info, "files": files}
    write_durably(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    with (directory / MANIFEST).open() as f:
        return json.load(f)


def verify(directory: Path) -> list[str]:
    """Every problem with a checkpoint directory, each naming the file; [] when it is complete and intact."""
    if not (directory / MANIFEST).is_file():
        return [f"{directory / MANIFEST}: missing (the save never committed)"]
    try:
        manifest = read_manifest(directory)
    except (OSError, json.JSONDecodeError) as err:
        return [f"{directory / MANIFEST}: unreadable ({err})"]
    problems = []
    if ".metadata" not in manifest.get("files", {}):
        problems.append(f"{directory / '.metadata'}: not listed in the manifest")
    for name, expected in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, expected {expected['bytes']}")
            continue
        found = sha256(path)
        if found != expected["sha256"]:
            problems.append(f"{path}: sha256 {found}, expected {expected['sha256']}")
    return problems
