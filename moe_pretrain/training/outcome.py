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

Rank 0 also writes run_dir/status.json ({"state", "exit_code", "step", "message", "checkpoint", "launch"}),
which the SLURM job script reads to decide whether to requeue: torchrun does not pass its workers' exit codes on.
A launch refused before it became the run (another live run holds the directory; the checkpoint belongs to
another model) exits 78 but leaves status.json to the run it describes: it writes run_dir/refused.json
instead ({"state": "refused", "exit_code", "message", "launch"}). Both carry the launch that wrote them
($MOE_PRETRAIN_LAUNCH_ID, which the job script sets for each of its runs; null elsewhere), and the job script reads
only the record of its own launch: a second launch by hand, refused beside the live run, never decides that run's
job.
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
                                           "launch": os.environ.get(LAUNCH_ID_VARIABLE)})
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
                                              "launch": os.environ.get(LAUNCH_ID_VARIABLE)})
        except OSError as err:
            log.warning(f"{REFUSED_FILE} not written in train.run_dir={run_dir}: {err.strerror or err}")
