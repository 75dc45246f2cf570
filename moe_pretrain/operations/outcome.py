"""How a training process ends: documented exit codes, and run_dir/status.json for job scripts.

Exit codes (every rank exits with the same one):
- 0  FINISHED   the run reached train.steps (or train.exit_at_step); a final checkpoint is committed.
- 75 REQUEUE    stopped on a preemption signal (SIGUSR2, SIGTERM) after committing a checkpoint:
                start the same job again and it resumes there (EX_TEMPFAIL).
- 76 HUNG       the watchdog found a step running far longer than usual and dumped every thread's stack
                to run_dir/hang/; a restart may help (a stuck peer or link).
- 78 PERMANENT  bad config, bad data, no checkpoint that verifies, repeated non-finite loss: starting
                again would fail the same way, so nothing should requeue it (EX_CONFIG).
- 74 STORAGE_FULL  a checkpoint could not be saved: its file system or quota is full (the partial save was
                removed, the previous checkpoint is intact). A requeue would fail the same way until a person frees
                space (EX_IOERR).
- 130 INTERRUPTED  stopped by Ctrl-C (SIGINT) after committing a checkpoint: relaunching resumes there;
                a person asked for the stop, so nothing requeues it (128 + SIGINT, the shell's convention).
- 77 LOST_PEER  a collective failed because a rank is gone (its process or node died): the remaining ranks name it
                (parallel/lost_peers.py); relaunching resumes from the last checkpoint, after a node check.
- anything else: a crash (a bug, a lost node): torchrun --max-restarts may restart it.

torchrun restarts its workers in place after any failure; a restart cannot change 75, 78, 74 or 130 (a preemption
by the clock wants the job requeued, a bad config or a full disk stay so, a person stopped the run) and would only
rebuild the model, resume and train again to the same end (for a full disk, to the next save, a checkpoint interval
of compute each time). So a restarted worker whose launch's run already ended so exits at once with the same code
(ended_before_restart), before torch is imported.

Rank 0 also writes run_dir/status.json ({"state", "exit_code", "step", "message", "checkpoint", "launch",
"torchrun"}),
which the SLURM job script reads to decide whether to requeue: torchrun does not pass its workers' exit codes on.
A launch refused before it became the run (another live run holds the directory; the checkpoint belongs to
another model) exits 78 but leaves status.json to the run it describes: it writes run_dir/refused.json
instead ({"state": "refused", "exit_code", "message", "launch", "torchrun"}). Both carry the launch that wrote them
($MOE_PRETRAIN_LAUNCH_ID, which the job script sets for each of its runs; null elsewhere), and the job script reads
only the record of its own launch: a second launch by hand, refused beside the live run, never decides that run's
job. "torchrun" is torchrun's id of its launch ($TORCHELASTIC_RUN_ID, the same for the worker groups it restarts;
null outside torchrun).
"""

import json
import logging
import os
from pathlib import Path

from moe_pretrain.config.errors import EX_CONFIG

log = logging.getLogger(__name__)
LAUNCH_ID_VARIABLE = "MOE_PRETRAIN_LAUNCH_ID"
"""The launch a status or refusal record belongs to (launch/slurm.py sets it: the job and its restart count)."""

FINISHED = 0
REQUEUE = 75
HUNG = 76
PERMANENT = EX_CONFIG
STORAGE_FULL = 74
INTERRUPTED = 130
LOST_PEER = 77

STATES = {FINISHED: "finished", REQUEUE: "preempted", HUNG: "hung", PERMANENT: "failed",
          STORAGE_FULL: "storage_full", INTERRUPTED: "interrupted", LOST_PEER: "lost_peer"}
REFUSED = "refused"
"""The state of a refused launch, in refused.json (never in status.json)."""
REFUSED_FILE = "refused.json"
TORCHRUN_RUN_VARIABLE = "TORCHELASTIC_RUN_ID"
"""torchrun's id of its launch, in every worker's environment and the same for the worker groups it restarts."""
NOT_RESTARTED = (REQUEUE, PERMANENT, STORAGE_FULL, INTERRUPTED)
"""Ends a restart in place cannot change."""


class Preempted(Exception):  # noqa: N818 (an outcome, not an error)
    """Raised on every rank once the checkpoint of a stop signal is committed: a preemption (requeue
    me) or, when interrupted, a Ctrl-C (a person stopped it)."""

    def __init__(self, step: int, checkpoint: Path | None, signal_name: str, interrupted: bool = False):
        verb = "interrupted" if interrupted else "preempted"
        super().__init__(f"{verb} by {signal_name} at step {step}; checkpoint {checkpoint} committed")
        self.step, self.checkpoint, self.signal_name, self.interrupted = step, checkpoint, signal_name, interrupted

    @property
    def exit_code(self) -> int:
        return INTERRUPTED if self.interrupted else REQUEUE


def _replace(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def write_status(run_dir: str | Path, exit_code: int, step: int, message: str, checkpoint: Path | None) -> None:
    """Atomically replace run_dir/status.json (rank 0 only). A run directory that cannot be written gets a
    warning: the exit code and the log line still say how the run ended."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _replace(run_dir / "status.json", {"state": STATES.get(exit_code, "crashed"), "exit_code": exit_code,
                                           "step": step, "message": message,
                                           "checkpoint": str(checkpoint) if checkpoint else None,
                                           "launch": os.environ.get(LAUNCH_ID_VARIABLE),
                                           "torchrun": os.environ.get(TORCHRUN_RUN_VARIABLE)})
    except OSError as err:
        log.warning(f"status.json not written in train.run_dir={run_dir}: {err.strerror or err}")


def write_refusal(run_dir: str | Path, message: str) -> None:
    """Record a refused launch in run_dir/refused.json (rank 0 only; status.json is left as it was). A run
    directory that is not a directory gets nothing, one that cannot be written a warning: the refusal's own line
    says why."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        try:
            _replace(run_dir / REFUSED_FILE, {"state": REFUSED, "exit_code": PERMANENT, "message": message,
                                              "launch": os.environ.get(LAUNCH_ID_VARIABLE),
                                           "torchrun": os.environ.get(TORCHRUN_RUN_VARIABLE)})
        except OSError as err:
            log.warning(f"{REFUSED_FILE} not written in train.run_dir={run_dir}: {err.strerror or err}")


def read_record(path: Path, written_since: float = 0.0) -> dict:
    """A status.json or refused.json as written (empty when missing, unreadable, or older than written_since)."""
    try:
        if path.stat().st_mtime < written_since:
            return {}
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def ended_before_restart(run_dir: str | Path) -> tuple[int, str] | None:
    """In a worker torchrun restarted in place ($TORCHELASTIC_RESTART_COUNT > 0): (exit code, why) when the worker
    group before it, of the same torchrun launch, ended with a code in NOT_RESTARTED (its status.json or
    refused.json says so); None otherwise, and outside a restart."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    launch = os.environ.get(TORCHRUN_RUN_VARIABLE)
    if restart == 0 or not launch:
        return None
    for name in ("status.json", REFUSED_FILE):
        record = read_record(Path(run_dir) / name)
        if record.get("torchrun") == launch and record.get("exit_code") in NOT_RESTARTED:
            return record["exit_code"], (f"torchrun's restart {restart} of this launch not run: the worker group "
                                         f"before it ended {record.get('state')} (exit {record['exit_code']}), which "
                                         "a restart in place cannot change")
    return None
