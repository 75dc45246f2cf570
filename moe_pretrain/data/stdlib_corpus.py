"""The default text corpus: the Python standard library's own source files.

Found through the running interpreter, so it needs no download and no data in the repository; the
file list is sorted, so the same interpreter gives the same corpus on every machine.
"""

import sysconfig
from functools import cache
from pathlib import Path

EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}


@cache
def stdlib_source_files() -> tuple[Path, ...]:
    """Every .py file under the interpreter's stdlib directory, sorted, third-party packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts) and p.is_file()
    )
    if not files:
        raise FileNotFoundError(f"no Python source files found under the stdlib directory {root}")
    return tuple(files)


def read_document(path: Path) -> bytes:
    return path.read_bytes()
