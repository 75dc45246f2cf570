"""The faults the soak (bench/soak.py) throws at a training job, each with the line of ours it must leave.

A fault is thrown at one of two moments. Between two attempts of the job, the checkpoint root, the run directory
or the checkpoint file system is damaged as a crash, an operator or the storage would: the next attempt must get
past it and say what it found. During an attempt, once the run has recorded a chosen step: a signal to the job
script (preemption, the time limit), a rank killed or stopped, a second launch by hand, the checkpoint file system
filled. Some of those end the attempt (the job script requeues it, or ends the job with a verdict an operator acts
on); a killed or stopped rank is restarted in place by torchrun.

Each kind's `said` is a regular expression over the job's log (or, where the throw returns an "output" file, that
file: a second launch's own output), formatted with what the throw returned: the line of ours that names this
fault, not a line any fault would leave.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from moe_pretrain.checkpoint import committed_checkpoints, verify
from moe_pretrain.operations.run_lock import LOCK


class Target(Protocol):
    """What a fault is thrown at: the running job as bench/soak.py holds it."""

    run_dir: Path
    checkpoint_root: Path
    file_system: Path
    damaged: set[str]
    checkpoint_bytes: int
    """A checkpoint's size on disk."""
    tensor_bytes: int
    """Its tensors' bytes."""

    def script_pid(self) -> int: ...
    def worker_pid(self, rank: int) -> int: ...
    def hand_launch(self, environment: dict[str, str]) -> Path:
        """A launch by hand beside the job, run to its end; -> its output's file."""
    def remount(self, mode: str) -> None: ...


@dataclass(frozen=True)
class FaultKind:
    name: str
    moment: Literal["between", "during"]
    throw: Callable[[Target, int], dict[str, str]]
    """(target, a seeded random number) -> the details `said` is formatted with."""
    said: str
    """The line of ours that names this fault (a regular expression, formatted with the throw's details)."""
    ends: Literal["", "requeue", "resubmit"] = ""
    """How the attempt ends after it: "" it goes on (torchrun restarts the workers in place, or nothing stops it);
    requeue (the job script requeues the job); resubmit (the job ends with a verdict; an operator mends the cause
    and submits it again)."""
    ready: Callable[[Target], bool] = lambda target: True
    """Whether the throw can be made now (else it waits for the next gap between attempts): a damaged newest
    checkpoint must leave a good one to resume, a `latest` must be there to delete, a stale lock must not hide
    another fault's."""
    restarts_workers: bool = False
    verdict: str = ""
    """What the job script must then say of the attempt (its state and srun's exit code: launch.torchrun keeps the
    rank's), a regular expression; "" for a fault the attempt goes on after."""
    slow_to_start: bool = False
    """The throw takes seconds (a process starting), during which the run trains on."""


def good_checkpoints(target: Target) -> list[Path]:
    """Committed checkpoints, newest first, that verify and that no fault damaged."""
    return [path for _, path in committed_checkpoints(target.checkpoint_root)
            if path.name not in target.damaged and not verify(path)]


def two_good_checkpoints(target: Target) -> bool:
    return len(good_checkpoints(target)) >= 2


def _damage_newest(target: Target, draw: int, mend: Callable[[Path], None]) -> dict[str, str]:
    newest = good_checkpoints(target)[0]
    shards = sorted(newest.glob("*.distcp"))
    shard = shards[draw % len(shards)]
    mend(shard)
    target.damaged.add(newest.name)
    return {"checkpoint": newest.name, "file": shard.name}


def truncate_shard(target: Target, draw: int) -> dict[str, str]:
    return _damage_newest(target, draw, lambda shard: os.truncate(shard, shard.stat().st_size // 2))


def delete_shard(target: Target, draw: int) -> dict[str, str]:
    return _damage_newest(target, draw, Path.unlink)


def delete_latest(target: Target, draw: int) -> dict[str, str]:
    (target.checkpoint_root / "latest").unlink()
    return {}


def stale_lock(target: Target, draw: int) -> dict[str, str]:
    """A lock left by a process on this host that is gone (a run killed with the node's power, say)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    holder = {"host": socket.gethostname(), "pid": gone.pid, "job": None, "token": "soak",
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (target.run_dir / LOCK).write_text(json.dumps(holder))
    return {"pid": str(gone.pid)}


def read_only_checkpoints(target: Target, draw: int) -> dict[str, str]:
    target.remount("ro")
    return {}


def signal_script(name: str) -> Callable[[Target, int], dict[str, str]]:
    def throw(target: Target, draw: int) -> dict[str, str]:
        os.kill(target.script_pid(), getattr(signal, name))
        return {}
    return throw


def signal_rank(sig: signal.Signals, procs: int) -> Callable[[Target, int], dict[str, str]]:
    def throw(target: Target, draw: int) -> dict[str, str]:
        rank = draw % procs
        os.kill(target.worker_pid(rank), sig)
        return {"rank": str(rank)}
    return throw


def second_launch(target: Target, draw: int) -> dict[str, str]:
    """A launch by hand on the live run's directory (no SLURM job): refused in one line, exit 78. Its line is in
    its own output."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("SLURM_", "MOE_PRETRAIN_"))}
    return {"output": str(target.hand_launch(environment))}


def fill_file_system(leave: Callable[[Target], int]) -> Callable[[Target, int], dict[str, str]]:
    """Ballast that leaves the checkpoint file system leave(target) bytes free."""
    def throw(target: Target, draw: int) -> dict[str, str]:
        stats = os.statvfs(target.file_system)
        with (target.file_system / "ballast").open("wb") as ballast:
            block = b"\0" * (1 << 20)
            left = stats.f_bavail * stats.f_frsize - leave(target)
            while left > 0:
                left -= ballast.write(block[:left])
        return {}
    return throw


def a_few_blocks(target: Target) -> int:
    """The start-up probe passes; the save's check of its planned bytes against the free space fails it."""
    return 64 * 1024


def more_than_planned(target: Target) -> int:
    """Between a checkpoint's tensor bytes (what the save plans, and checks the free space for) and its size on
    disk (DCP's serialisation adds to them): the check passes and the write fails midway."""
    return (target.tensor_bytes + target.checkpoint_bytes) // 2


def ended(state: str, code: int) -> str:
    return rf"training ended with state {state} \(srun exit {code}\)"


def kinds(procs: int) -> dict[str, FaultKind]:
    """Every kind the soak throws, by name, for a job of `procs` ranks."""
    preempted = r"preempted by SIGUSR2 at step \d+; checkpoint \S+ committed"
    every = [
        FaultKind("truncated shard", "between", truncate_shard, r"moved damaged {checkpoint} aside",
                  ready=two_good_checkpoints),
        FaultKind("deleted shard", "between", delete_shard, r"moved damaged {checkpoint} aside",
                  ready=two_good_checkpoints),
        FaultKind("deleted latest", "between", delete_latest, r"latest now names step_\d+ \(it was missing\)",
                  ready=lambda target: (target.checkpoint_root / "latest").is_file()),
        FaultKind("stale run.lock", "between", stale_lock,
                  r"took over the lock of a run that is gone \(host \S+ pid {pid}\b.*no longer runs on this host",
                  ready=lambda target: not (target.run_dir / LOCK).exists()),
        FaultKind("read-only checkpoint dir", "between", read_only_checkpoints,
                  r"config error \(rank 0\): checkpoint\.dir=\S+ cannot be written: Read-only file system",
                  ends="resubmit", verdict=ended("failed", 78)),
        FaultKind("SIGTERM (preemption)", "during", signal_script("SIGTERM"),
                  r"SIGTERM received, forwarding SIGUSR2(?s:.*)" + preempted, ends="requeue",
                  verdict=ended("preempted", 75)),
        FaultKind("SIGUSR2 (time limit)", "during", signal_script("SIGUSR2"),
                  r"SIGUSR2 received, forwarding SIGUSR2(?s:.*)" + preempted, ends="requeue",
                  verdict=ended("preempted", 75)),
        FaultKind("full disk, found before a save", "during", fill_file_system(a_few_blocks),
                  r"storage full \(rank \d+\): .*No space left on device: the save needs .*\(checked before writing\)",
                  ends="resubmit", verdict=ended("storage_full", 74)),
        FaultKind("full disk during a save's write", "during", fill_file_system(more_than_planned),
                  r"storage full \(rank \d+\): checkpoint\.dir=\S+ is full: ENOSPC, No space left on device "
                  r"\(rank \d+\)\.",
                  ends="resubmit", verdict=ended("storage_full", 74)),
        FaultKind("SIGKILL of a rank", "during", signal_rank(signal.SIGKILL, procs),
                  r"lost peer \(rank \d+\): lost rank {rank} \(host \S+\) at step \d+", restarts_workers=True),
        FaultKind("hung rank (SIGSTOP)", "during", signal_rank(signal.SIGSTOP, procs),
                  r"watchdog \(rank \d+ on \S+\): step \d+ has run [\d.]+ s, more than train\.hang_multiple",
                  restarts_workers=True),
        FaultKind("second launch", "during", second_launch,
                  r"refused \(rank 0\): train\.run_dir=\S+ is in use by another run", slow_to_start=True),
    ]
    return {kind.name: kind for kind in every}


def line_naming(kind: FaultKind, details: dict[str, str], text: str) -> str | None:
    """The line of `text` that names the fault (the last line of a match over several), or None."""
    pattern = kind.said.format(**{key: re.escape(value) for key, value in details.items()})
    found = re.search(pattern, text)
    return found.group(0).splitlines()[-1] if found else None
