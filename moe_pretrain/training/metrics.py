"""Step metrics: one JSON object per optimizer step in metrics.jsonl, and the terminal progress bar."""

import json
import sys
from pathlib import Path
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, path: Path, resuming: bool = False):
        self.path = path
        # A fresh run never clobbers another run's metrics; a resumed one appends (after a crash, steps
        # between the checkpoint and the crash appear twice: the later line is the one that counts).
        self._file = path.open("a" if resuming else "x")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressBar:
    """A bar redrawn in place on a terminal, or a plain line every `every` steps in a log file."""

    def __init__(self, total: int, every: int, enabled: bool = True, stream: TextIO = sys.stdout):
        self.total, self.every, self.enabled, self.stream = total, every, enabled, stream
        self.interactive = stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        if not self.enabled:
            return
        done = step + 1
        width = 24
        filled = width * done // self.total
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {done}/{self.total} "
                f"loss {loss:.4f} lr {lr:.2e} {tokens_per_s:,.0f} tok/s")
        if self.interactive:
            end = "\n" if done == self.total else ""
            print("\r" + line, end=end, file=self.stream, flush=True)
        elif done % self.every == 0 or done == 1 or done == self.total:
            print(line, file=self.stream, flush=True)
