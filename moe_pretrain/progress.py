"""Progress lines shared by training and preprocessing: a bar redrawn in place on a terminal, whole lines
in a log file (where carriage returns would pile up)."""

from typing import TextIO


def bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}]"


def show(line: str, stream: TextIO, final: bool) -> None:
    if stream.isatty():
        print("\r" + line, end="\n" if final else "", file=stream, flush=True)
    else:
        print(line, file=stream, flush=True)
