"""A single-node SLURM cluster for tests: munge, slurmctld and slurmd as root with a private config.

Needs the Debian packages slurm-wlm and munge (.ci/run installs them) and root. `start()` raises
ClusterUnavailableError with the reason when either is missing, and the tests skip with that reason.
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


class ClusterUnavailableError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(*args: str, env: dict | None = None, check: bool = True) -> str:
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "Cluster":
        missing = [b for b in ("munge", "munged", "slurmctld", "slurmd", "sbatch", "scontrol") if not shutil.which(b)]
        if missing:
            raise ClusterUnavailableError(f"SLURM is not installed ({', '.join(missing)} not found; .ci/run installs "
                                     "slurm-wlm and munge from Debian)")
        if os.geteuid() != 0:
            raise ClusterUnavailableError("a test SLURM cluster runs its daemons as root; this is not root")
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        if subprocess.run(["munge", "-n"], capture_output=True, timeout=30).returncode != 0:
            # No munged answering (never started, or a stale socket a dead one left behind): start one.
            _run("munged", "--force")
        host = self.node = socket.gethostname().split(".")[0]
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=moetest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "JobRequeue=1", "ReturnToService=2",
            "MpiDefault=none", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", "SchedulerParameters=sched_interval=2",
            f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        _run("slurmctld", "-i", "-f", str(self.conf), env=self.env)
        _run("slurmd", "-f", str(self.conf), env=self.env)
        deadline = time.time() + 60
        while "idle" not in _run("sinfo", "-h", "-o", "%T", env=self.env, check=False):
            if time.time() > deadline:
                self.stop()
                raise ClusterUnavailableError(f"the test cluster did not come up; see {r}/slurmctld.log")
            time.sleep(0.5)
        return self

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, Restarts, ...)."""
        text = _run("scontrol", "show", "job", job_id, env=self.env, check=False)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} is {info.get('JobState')} after {timeout} s, not in {states}")
            time.sleep(1)

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of slurmctld's and slurmd's logs, for a failing test's message."""
        tails = []
        for daemon in ("slurmctld", "slurmd"):
            log = self.root / f"{daemon}.log"
            text = log.read_text().splitlines()[-lines:] if log.exists() else ["(no log)"]
            tails.append(f"--- {log}\n" + "\n".join(text))
        return "\n".join(tails)

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{daemon}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), 15)
                except (ProcessLookupError, ValueError):
                    pass
