"""One live run per run directory: run_dir/run.lock, taken by rank 0 before anything is built or resumed.

Two runs on one directory train into one checkpoint directory, rename each other's metrics and overwrite each
other's status.json (a finished run's `finished` replaced by the loser's `failed`, so SLURM would not requeue
what needed it or would requeue what had ended). SLURM's --dependency=singleton only keeps apart jobs of one
name; the lock keeps apart everything else: a second launch by hand, another job name, a run started outside
SLURM.

The lock file is created with O_EXCL and names its holder (host, pid, SLURM job, start time); a thread touches it
every HEARTBEAT_S while the run lives, and release() removes it on any exit the process survives. A lock left by
a process that died is taken over, with a warning naming it, when its holder is provably gone: its pid no longer
runs on this host, it was an earlier attempt of this SLURM job (a requeue or a torchrun restart: SLURM runs one
attempt of a job at a time), or its heartbeat is older than STALE_S (a dead host). Otherwise the run is refused
in one line naming the holder.
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from moe_pretrain.config import ConfigError

log = logging.getLogger(__name__)

LOCK = "run.lock"
HEARTBEAT_S = 30.0
"""How often the holder touches the lock."""
STALE_S = 300.0
"""A lock untouched this long belongs to a dead host (ten missed heartbeats: a stalled file system is not death)."""


class RunDirBusyError(RuntimeError):
    """Another live run holds this run directory (the message names it)."""


def _holder_text(holder: dict[str, Any], age_s: float) -> str:
    job = f", SLURM job {holder['job']}" if holder.get("job") else ""
    return (f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}{job}, started {holder.get('started', '?')}, "
            f"heartbeat {age_s:.0f} s ago")


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def stale_reason(holder: dict[str, Any], age_s: float, host: str, job: str | None) -> str | None:
    """Why the holder is provably gone (None: it may be alive)."""
    if job and holder.get("job") == job:
        return f"it was an earlier attempt of this SLURM job {job}"
    pid = holder.get("pid")
    if holder.get("host") == host and isinstance(pid, int) and (pid == os.getpid() or not _pid_running(pid)):
        return f"its process {holder['pid']} no longer runs on this host"
    if age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago (more than {STALE_S:.0f} s)"
    return None


class RunDirLock:
    """The run directory's lock, held from acquire() to release() (rank 0 only)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise RunDirBusyError naming the live holder (ConfigError when the run directory
        cannot be a directory)."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"train.run_dir={self.run_dir} is a file, not a directory")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"train.run_dir={self.run_dir} cannot be created: {err.strerror}") from None
        host, job = socket.gethostname(), os.environ.get("SLURM_JOB_ID")
        mine = {"host": host, "pid": os.getpid(), "job": job, "token": self.token,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        for _ in range(3):  # a take-over races at most a few other takers
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age_s = self._read()
                reason = stale_reason(holder, age_s, host, job)
                if reason is None:
                    raise RunDirBusyError(
                        f"train.run_dir={self.run_dir} is in use by another run ({_holder_text(holder, age_s)}): "
                        f"one run per run directory. If that run is dead, remove {self.path}") from None
                self._take_over(holder, age_s, reason)
                continue
            except OSError as err:  # read-only, no permission: one line, not the traceback of a crash
                raise ConfigError(f"train.run_dir={self.run_dir} cannot be written: {err.strerror or err}") from None
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise RunDirBusyError(f"train.run_dir={self.run_dir}: {self.path} keeps being taken by other runs")

    def _read(self) -> tuple[dict[str, Any], float]:
        """The holder as written (empty if unreadable: a holder that died while writing it) and the lock's age."""
        try:
            age_s = time.time() - self.path.stat().st_mtime
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}, 0.0
        except (OSError, ValueError):
            holder = {}
        return (holder if isinstance(holder, dict) else {}), age_s

    def _take_over(self, holder: dict[str, Any], age_s: float, reason: str) -> None:
        """Move the dead holder's lock aside (rename is atomic: of several takers one wins, the others retry)."""
        aside = self.path.with_name(f"{LOCK}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        aside.unlink()
        log.warning(f"run directory {self.run_dir}: took over the lock of a run that is gone "
                    f"({_holder_text(holder, age_s)}): {reason}")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError as err:  # a file system hiccup: the next beat tries again
                log.warning(f"run directory lock {self.path}: heartbeat failed: {err}")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this holder's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder, _ = self._read()
            if holder.get("token") == self.token:
                self.path.unlink(missing_ok=True)
