"""Damaged checkpoints are moved aside, never deleted, and `latest` follows the checkpoint actually resumed.

resume=auto skips a step_<N> that does not verify (a truncated shard, a missing manifest, a flipped byte) and
resumes the newest one that does. Left under its name, the damaged step_<N> would block the run for good: the
resumed run reaches step N again, its save finds step_<N> taken (a checkpoint is never overwritten) and the run
fails at the same step on every relaunch, losing the work in between each time. So once a good checkpoint has
been found, each damaged one newer than it is renamed to step_<N>.damaged-<UTC time> (out of the checkpoint
namespace: never a resume candidate, never pruned), with DAMAGED.txt inside saying why and when, and `latest`
names the resumed checkpoint. Its bytes stay for a person to inspect or repair.
"""

import logging
import os
import time
from pathlib import Path

from moe_pretrain.checkpoint.directory import DAMAGED, LATEST
from moe_pretrain.checkpoint.manifest import fsync_dir, write_durably

log = logging.getLogger(__name__)

REASON = "DAMAGED.txt"
"""Inside a quarantined directory: why it was moved aside, when, and by which run."""


def quarantine(path: Path, problems: list[str], resumed: Path) -> Path:
    """Rename a damaged checkpoint out of the checkpoint namespace and record why; returns its new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}{DAMAGED}-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = path.with_name(f"{path.name}{DAMAGED}-{stamp}-{suffix}")
    os.rename(path, target)
    fsync_dir(path.parent)
    reason = (f"moved aside from {path.name} at {stamp} by host {os.uname().nodename} pid {os.getpid()}, which "
              f"resumed {resumed.name} instead, because it does not verify:\n" + "\n".join(problems) + "\n")
    try:
        write_durably(target / REASON, reason)
    except OSError as err:  # the rename is what matters; the reason is also in the log
        log.warning(f"checkpoint: could not write {target / REASON}: {err}")
    log.warning(f"checkpoint: moved damaged {path.name} aside to {target.name} (nothing deleted; why: "
                f"{target / REASON})")
    return target


def point_latest(root: Path, resumed: Path) -> None:
    """`latest` names the checkpoint the run resumed from (the next commit moves it on)."""
    latest = root / LATEST
    current = latest.read_text().strip() if latest.is_file() else None
    if resumed.parent == root and current != resumed.name:
        write_durably(latest, resumed.name + "\n")
        was = f"it named {current}" if current else "it was missing"
        log.warning(f"checkpoint: {latest} now names {resumed.name} ({was})")
