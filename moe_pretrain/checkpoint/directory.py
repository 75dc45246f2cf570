"""The names in a checkpoint root: step_<N>/ (committed), step_<N>.tmp/ (being written), `latest` (the
newest committed, by name), step_<N>.<tag>.deleting/ (pruned, being deleted: pruning.py) and
step_<N>.damaged-<time>/ (failed verification at a resume, moved aside and kept: quarantine.py). Only a name
that matches STEP_DIR is ever a checkpoint; the others are never read by find() or `latest`, nor pruned.
"""

import re
from pathlib import Path

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
DELETING = ".deleting"
DAMAGED = ".damaged"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of committed-looking checkpoint directories, newest first (verification not done)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def being_deleted(root: Path) -> list[Path]:
    """Pruned checkpoints whose deletion has not finished (still running, or cut short by a crash)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(DELETING))
