"""Step metrics: one JSON object per optimizer step in metrics.jsonl, and the terminal progress bar."""

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from moe_pretrain.progress import bar, show

log = logging.getLogger(__name__)


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a step record under slash-separated names (moe/3/router_entropy); lists and text
    (per-expert loads, the stage name) are left to metrics.jsonl."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and key != "step":
            out[name] = float(value)
    return out


def tensorboard_writer(directory: Path):
    """A torch SummaryWriter, or None (said once) when the optional tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("metrics: the tensorboard package is not installed, so no event files are written "
                    "(pip install 'moe-pretrain[tensorboard]')")
        return None
    return SummaryWriter(str(directory))


class MetricsWriter:
    """metrics.jsonl (every field), and the same scalars as TensorBoard events when asked and available."""

    def __init__(self, path: Path, resuming: bool = False, tensorboard: bool = False, wandb_run: Any = None):
        self.path = path
        # A fresh run never clobbers another run's metrics; a resumed one appends (after a crash, steps
        # between the checkpoint and the crash appear twice: the later line is the one that counts).
        self._file = path.open("a" if resuming else "x")
        self._events = tensorboard_writer(path.parent / "tensorboard") if tensorboard else None
        self._wandb = wandb_run
        """A W&B run (wandb_run.py) that gets the same scalars, or None."""

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._events is not None:
            for name, value in scalars(record).items():
                self._events.add_scalar(name, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()
        if self._wandb is not None:
            self._wandb.finish()


class ProgressBar:
    """A bar redrawn in place on a terminal, or a plain line every `every` steps in a log file."""

    def __init__(self, total: int, every: int, enabled: bool = True, stream: TextIO = sys.stdout):
        self.total, self.every, self.enabled, self.stream = total, every, enabled, stream
        self.interactive = stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float, eval_loss: float | None = None) -> None:
        """A step's line; a step with a held-out evaluation always gets one, with its loss (kept on screen)."""
        if not self.enabled:
            return
        done = step + 1
        evaluated = f" eval {eval_loss:.4f}" if eval_loss is not None else ""
        if self.interactive or done % self.every == 0 or done == 1 or done == self.total or evaluated:
            show(f"{bar(done, self.total)} step {done}/{self.total} loss {loss:.4f}{evaluated} lr {lr:.2e} "
                 f"{tokens_per_s:,.0f} tok/s", self.stream, final=done == self.total or bool(evaluated))
