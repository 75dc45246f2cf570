"""Training runs started as processes, for the tests that signal, interrupt or watch them."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import steps_done
from tests.models import TINY

TRAIN = [sys.executable, "-m", "launch.train", "--config", "configs/smoke.yaml", *TINY, "logging.progress=false"]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while steps_done(run_dir) < step:
        assert proc.poll() is None, "the run ended before it was interrupted"
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.2)


def signal_long_run(command: list[str], run_dir: Path, sig: signal.Signals, step: int = 3
                    ) -> tuple[subprocess.Popen, str, str]:
    """Start a long run, send sig once it has recorded `step` steps, and wait for it to end."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run_dir, step)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=150)
    return proc, out, err
