"""Fault-injection soak: the smoke model trained under the SLURM job script while a seeded injector throws faults
at it, relaunched as the job script and an operator would; it passes when the run finishes with the weights of an
uninterrupted run, bit for bit.

Run (as root: the checkpoints live on a tmpfs of their own, filled and remounted read-only by two of the faults):

    .venv/bin/python bench/soak.py [--steps 300 --every 10 --faults 30 --procs 2 --seed 0 --dir DIR]

The job is launch/slurm.py's rendered script, run by bash with stand-ins for SLURM's programs first on PATH: srun
runs its step's command on this machine (launch.torchrun with --procs ranks, or the node check), scontrol answers
for one node and records the script's requeues, squeue says nothing (the script's clock stop then follows --time).
A requeue starts the script again as the job's next restart; a job that ends with a verdict an operator acts on
(the checkpoint file system full, exit 74; refused for a read-only checkpoint directory, exit 78) is mended and
submitted again as a new job. An uninterrupted run of the same job comes first: the reference.

The seeded schedule (schedule()) holds every kind of bench/soak_faults.py at least once, then kinds drawn at random
up to --faults, spread over the job's attempts: between attempts (a damaged newest checkpoint, a deleted `latest`,
a stale run.lock, a read-only checkpoint directory) and during them at a drawn step (SIGTERM and SIGUSR2 to the
script, SIGKILL or SIGSTOP of a rank, a second launch by hand, the checkpoint file system filled so that the next
save is refused before it writes, or fails midway).

It passes when: the run finished (status.json); its final checkpoint holds the reference's tensors bit for bit
(model and optimizer); every step it recorded, repeats after a resume included, has the reference's loss; every
checkpoint that verified after an attempt and that no fault damaged still verifies; every fault left the line of
ours that names it (the table); and no log of the job (nor of a launch by hand) holds a traceback. Printed: that
table, the effective training time (steps kept / steps run: steps trained again after a resume from an earlier
checkpoint count as run, not kept), the job's attempts and wall time.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from bench.soak_faults import FaultKind, good_checkpoints, kinds, line_naming  # noqa: E402
from launch.local import free_port  # noqa: E402
from launch.slurm import JobRequest, render  # noqa: E402
from moe_pretrain.checkpoint import verify  # noqa: E402
from moe_pretrain.checkpoint.directory import step_dir  # noqa: E402
from moe_pretrain.config import load_config  # noqa: E402
from tests.models import TINY  # noqa: E402

CONFIG = "configs/smoke.yaml"
NODE = "localhost"
"""The one node the stand-ins answer for (it must resolve: the rendezvous is on it)."""
FIRST_JOB = 7
ATTEMPT_TIMEOUT_S = 900.0
"""One attempt of the job, faults and restarts included: minutes here; far past it, the soak is stuck."""
STEPS_BEFORE_A_FAULT = 4
"""Steps a (re)started run records before the next fault: the watchdog judges a hang by the median of at least
three steps of its own process (watchdog.MIN_STEPS_FOR_MEDIAN)."""
HANG_MIN_S = 8.0
"""train.hang_min_s of the soak: a stopped rank is found this long after its step began (30 times a step here)."""

STAND_INS = {
    "srun": f"""#!/bin/bash
# srun on one node: its step's command, without srun's options, as the node's one task.
while [ $# -gt 0 ] && [ "${{1#--}}" != "$1" ]; do shift; done
export SLURMD_NODENAME={NODE}
exec "$@"
""",
    "scontrol": f"""#!/bin/bash
echo "$@" >> "$SOAK_SCONTROL_LOG"
case "$1 $2" in
  "show hostnames") echo {NODE} ;;
  "show job") echo "JobId=$SLURM_JOB_ID ExcNodeList=(null) Restarts=${{SLURM_RESTART_COUNT:-0}}" ;;
esac
""",
    "squeue": "#!/bin/bash\n",
}
"""SLURM's programs as the job script calls them, for one node on this machine."""


class SoakError(RuntimeError):
    """The soak cannot go on: an attempt ended in a way no fault explains, or hung past ATTEMPT_TIMEOUT_S."""


@dataclass
class AttemptPlan:
    """The faults of one attempt of the job: `before` it starts, `during` it (in order), and the one that ends it
    (None: the attempt runs to the end of training)."""

    before: list[FaultKind] = field(default_factory=list)
    during: list[FaultKind] = field(default_factory=list)
    ending: FaultKind | None = None


@dataclass
class Thrown:
    kind: FaultKind
    where: str
    """When it was thrown: "at job 7.2 step 31" (the step the run had recorded) or "after job 7.2"."""
    details: dict[str, str]
    logs: list[Path]
    """The attempt logs its line is looked for in (a second launch's own output is in details)."""
    line: str | None = None


@dataclass
class SoakResult:
    thrown: list[Thrown]
    steps: int
    steps_run: int
    attempts: list[str]
    wall_s: float
    problems: list[str]


def schedule(rng: random.Random, every_kind: dict[str, FaultKind], total: int, steps: int, every: int,
             max_restarts: int) -> list[AttemptPlan]:
    """Every kind once, then kinds drawn at random up to `total`, spread over the job's attempts: each fault that
    ends an attempt makes one, and a last attempt runs to the end; the others go into attempts drawn at random
    (faults between attempts never before the first; at most max_restarts worker restarts in one attempt, which
    is what torchrun grants it; a second launch first in an attempt of the first half, as the run trains on for the
    seconds it takes to start)."""
    names = list(every_kind) + [rng.choice(sorted(every_kind)) for _ in range(total - len(every_kind))]
    faults = [every_kind[name] for name in names]
    rng.shuffle(faults)
    endings = [fault for fault in faults if fault.moment == "during" and fault.ends]
    plans = [AttemptPlan(ending=ending) for ending in endings] + [AttemptPlan()]
    for fault in faults:
        if fault.moment == "between":
            rng.choice(plans[1:]).before.append(fault)
        elif not fault.ends:
            room = [plan for plan in plans[:max(1, len(plans) // 2) if fault.slow_to_start else -1]
                    if not fault.restarts_workers or sum(f.restarts_workers for f in plan.during) < max_restarts]
            during = rng.choice(room).during
            during.insert(0 if fault.slow_to_start else len(during), fault)
    return plans


def job_overrides(run_dir: Path, checkpoint_root: Path, steps: int, every: int, port: int) -> list[str]:
    """The smoke model shrunk (tests/models.py's TINY) on tp 2 x ep 2, a checkpoint every `every` steps and all
    of them kept (the soak checks none that verified is lost), a watchdog that finds a stopped rank in seconds, and
    failed runs requeued without the usual limit (the soak fails many on purpose)."""
    return [*TINY, f"train.steps={steps}", f"train.run_dir={run_dir}", f"checkpoint.dir={checkpoint_root}",
            f"checkpoint.every={every}", "checkpoint.every_minutes=0", "checkpoint.keep_last=100000",
            f"train.hang_min_s={HANG_MIN_S:g}", "train.hang_timeout_s=300", "logging.progress=false",
            "parallel.tp=2", "parallel.ep=2", f"launch.python={sys.executable}", "launch.signal_lead_s=20",
            f"launch.rdzv_port={port}", "launch.max_requeues=100000"]


class Job:
    """One training job under the rendered script and the stand-ins: its attempts, launched one at a time as
    SLURM would (a requeue: the next restart; a resubmission: the next job id). It is what faults are thrown at
    (bench/soak_faults.Target)."""

    def __init__(self, root: Path, steps: int, every: int, procs: int, file_system: Path | None = None,
                 checkpoint_bytes: int = 0, tensor_bytes: int = 0):
        self.root, self.steps, self.every, self.procs = root, steps, every, procs
        self.checkpoint_bytes, self.tensor_bytes = checkpoint_bytes, tensor_bytes
        self.run_dir = root / "run"
        self.file_system = file_system or root
        self.checkpoint_root = self.file_system / "checkpoints"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.overrides = job_overrides(self.run_dir, self.checkpoint_root, steps, every, free_port())
        request = JobRequest([CONFIG], self.overrides, nodes=1, gpus_per_node=0, time="02:00:00",
                             procs_per_node=procs, workdir=str(ROOT))
        self.script = root / "job.sbatch"
        self.script.write_text(render(request, load_config(CONFIG, self.overrides)))
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for name, body in STAND_INS.items():
            (bin_dir / name).write_text(body)
            (bin_dir / name).chmod(0o755)
        self.scontrol_log = root / "scontrol.log"
        self.scontrol_log.touch()
        self.environment = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": NODE,
                            "SOAK_SCONTROL_LOG": str(self.scontrol_log)}
        self.job_id, self.restart = FIRST_JOB, 0
        self.damaged: set[str] = set()
        self.verified: set[str] = set()
        self.attempts: list[str] = []
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None
        self.hand_launches: dict[str, subprocess.Popen] = {}

    # bench/soak_faults.Target
    def script_pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def worker_pid(self, rank: int) -> int:
        """The live training process of this attempt with this rank (a torchrun restart's, after one)."""
        wanted = {f"MOE_PRETRAIN_LAUNCH_ID={self.job_id}.{self.restart}", f"RANK={rank}"}
        deadline = time.time() + 30
        while time.time() < deadline:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and wanted <= _environment(entry) and _state(entry) not in ("Z", "T", ""):
                    return int(entry.name)
            time.sleep(0.2)
        raise SoakError(f"no live rank {rank} of job {self.job_id}.{self.restart} found")

    def hand_launch(self, environment: dict[str, str]) -> Path:
        """One process (a person trying the run on its own, say): it starts sooner than the job's ranks, and must
        meet this attempt's run, not a later one's, so it is waited for before anything else is thrown."""
        output = self.logs / f"hand-launch-{len(self.hand_launches) + 1}.log"
        command = [sys.executable, "-m", "launch.train", "--config", CONFIG, *self.overrides, "parallel.tp=1",
                   "parallel.ep=1"]
        with output.open("w") as log:
            launch = self.hand_launches[str(output)] = subprocess.Popen(command, env=environment, stdout=log,
                                                                        stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            launch.wait(timeout=max(1.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise SoakError(f"a launch by hand beside {self.attempts[-1]} did not end; see {output}") from None
        return output

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.file_system)], check=True, capture_output=True)

    # attempts
    def start(self) -> None:
        name = f"job {self.job_id}.{self.restart}"
        self.attempts.append(name)
        self.log = self.logs / f"{self.job_id}.{self.restart}.log"
        self.scontrol_seen = self.scontrol_log.stat().st_size
        environment = {**self.environment, "SLURM_JOB_ID": str(self.job_id),
                       "SLURM_RESTART_COUNT": str(self.restart)}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(["bash", str(self.script)], env=environment, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.deadline = time.time() + ATTEMPT_TIMEOUT_S

    def records(self, cursor: tuple[int, int]) -> tuple[list[dict], tuple[int, int]]:
        """metrics.jsonl's whole records after `cursor` (its file's inode and a byte offset), and the cursor after
        them. A run restarted before its first checkpoint starts a new file (run_loop.py keeps the old one as
        metrics.attempt<N>.jsonl): its records count from its start."""
        path = self.run_dir / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                f.seek(cursor[1] if inode == cursor[0] else 0)
                start, text = f.tell(), f.read()
        except FileNotFoundError:
            return [], cursor
        whole = text[:text.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines()], (inode, start + len(whole))

    def newest_step(self) -> int:
        return max((record["step"] for record in self.records((-1, 0))[0]), default=0)

    def metrics_end(self) -> tuple[int, int]:
        """The cursor after metrics.jsonl's last whole record (a record may be half written now)."""
        return self.records((-1, 0))[1]

    def wait_for_step(self, cursor: tuple[int, int], at_least: int = 0) -> int:
        """The newest step recorded after `cursor`, once there is one >= at_least."""
        newest = -1
        while True:
            found, cursor = self.records(cursor)
            newest = max([newest, *(record["step"] for record in found)])
            if newest >= max(at_least, 0):
                return newest
            self.check_alive(f"step {max(at_least, 1)}")
            time.sleep(0.05)

    def check_alive(self, waiting_for: str) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise SoakError(f"{self.attempts[-1]} ended (exit {self.process.returncode}) while the soak waited for "
                            f"{waiting_for}; its log: {self.log}\n{_tail(self.log)}")
        if time.time() > self.deadline:
            self.kill()
            raise SoakError(f"{self.attempts[-1]} still ran after {ATTEMPT_TIMEOUT_S:.0f} s waiting for "
                            f"{waiting_for}; its log: {self.log}\n{_tail(self.log)}")

    def finish(self) -> tuple[int, bool]:
        """Wait for the attempt to end: (the script's exit code, whether it requeued the job)."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=max(1.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise SoakError(f"{self.attempts[-1]} did not end; its log: {self.log}\n{_tail(self.log)}") from None
        with self.scontrol_log.open() as f:
            f.seek(self.scontrol_seen)
            calls = f.read().splitlines()
        requeued = any(call in (f"requeue {self.job_id}", f"release {self.job_id}") for call in calls)
        for path in good_checkpoints(self):
            self.verified.add(path.name)
        return code, requeued

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for launch in self.hand_launches.values():
            if launch.poll() is None:
                launch.kill()
                launch.wait()

    def next_attempt(self, requeued: bool) -> None:
        """As SLURM would: a requeue restarts the job; otherwise an operator submits it again (a new job id)."""
        if requeued:
            self.restart += 1
        else:
            self.job_id, self.restart = self.job_id + 1, 0


def _environment(process: Path) -> set[str]:
    try:
        return set((process / "environ").read_bytes().decode(errors="replace").split("\0"))
    except OSError:
        return set()


def _state(process: Path) -> str:
    try:
        return (process / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _tail(log: Path | None, lines: int = 40) -> str:
    return "\n".join(log.read_text().splitlines()[-lines:]) if log and log.exists() else "(no log)"


def throw(job: Job, kind: FaultKind, rng: random.Random, where: str) -> Thrown:
    details = kind.throw(job, rng.randrange(1 << 30))
    took = f" (the run at step {job.newest_step()} when it was done)" if kind.slow_to_start else ""
    print(f"soak: {kind.name} {where}{took}", flush=True)
    return Thrown(kind, where, details, [])


def between(job: Job, plan: AttemptPlan, rng: random.Random) -> list[Thrown]:
    """Throw the plan's between-attempt faults, each when it is ready (FaultKind.ready; else in a later gap); a
    read-only checkpoint directory goes last (the others must still write), its attempt is
    refused at start, and the operator remounts it and submits the job again."""
    thrown, deferred = [], []
    for kind in sorted(plan.before, key=lambda k: k.ends == "resubmit"):
        if not kind.ready(job):
            deferred.append(kind)
            continue
        thrown.append(throw(job, kind, rng, f"after {job.attempts[-1]}"))
        if kind.ends == "resubmit":
            job.start()
            thrown[-1].logs.append(job.log)
            code, requeued = job.finish()
            if code != 78 or requeued:
                raise SoakError(f"{job.attempts[-1]} on a read-only checkpoint directory ended with exit {code}"
                                f"{' and requeued' if requeued else ''}, not 78; its log: {job.log}")
            job.remount("rw")
            job.next_attempt(requeued=False)
    plan.before = deferred
    return thrown


def during(job: Job, plan: AttemptPlan, rng: random.Random, attempts_left: int = 1) -> list[Thrown]:
    """Start the attempt and throw its faults at drawn steps, each once the run (restarted, after a rank's fault)
    has recorded STEPS_BEFORE_A_FAULT steps; the ending fault once this attempt has had its share of the steps left
    (they are shared evenly by the attempts left, and kept clear of the last save). Returns once the attempt has
    ended and the job is ready for its next one."""
    job.start()
    thrown: list[Thrown] = []
    cursor = job.metrics_end()
    faults = [*plan.during, *([plan.ending] if plan.ending else [])]
    end_step = 0
    for left, kind in zip(range(len(faults), 0, -1), faults, strict=True):
        newest = job.wait_for_step(cursor)
        if not end_step:
            last = job.steps - job.every - 2
            end_step = newest + max(0, last - newest) // attempts_left
        earliest = newest + STEPS_BEFORE_A_FAULT
        if kind is plan.ending:
            at = max(earliest, end_step)
        else:
            at = earliest + rng.randint(0, max(0, (end_step - earliest) // left))
        step = job.wait_for_step(cursor, at)
        if kind.restarts_workers:
            cursor = job.metrics_end()  # the restarted workers' records come after this
        thrown.append(throw(job, kind, rng, f"at {job.attempts[-1]} step {step}"))
        thrown[-1].logs.append(job.log)
    code, requeued = job.finish()
    ending = plan.ending
    if ending is None:
        if code != 0 or requeued:
            raise SoakError(f"the last attempt {job.attempts[-1]} ended with exit {code}; its log: {job.log}")
    elif (ending.ends == "requeue") != requeued:
        raise SoakError(f"{job.attempts[-1]} ended with exit {code} and was {'' if requeued else 'not '}requeued "
                        f"after {ending.name}; its log: {job.log}\n{_tail(job.log)}")
    elif ending.ends == "resubmit":
        (job.file_system / "ballast").unlink(missing_ok=True)  # the operator frees the space
    job.next_attempt(requeued)
    return thrown


def run_job(job: Job, plans: list[AttemptPlan], rng: random.Random) -> list[Thrown]:
    thrown: list[Thrown] = []
    for number, plan in enumerate(plans):
        first = len(job.attempts)
        before = []
        if number:
            plan.before[:0] = plans[number - 1].before  # deferred from the gap before
            before = between(job, plan, rng)
        thrown += before
        thrown += during(job, plan, rng, attempts_left=len(plans) - number)
        for fault in before:  # the line may be in any attempt since the gap (a refused one takes the lock too)
            fault.logs = [job.logs / f"{name.split()[1]}.log" for name in job.attempts[first:]]
    if plans[-1].before:
        raise SoakError(f"{len(plans[-1].before)} faults between attempts were never ready to be thrown")
    return thrown


def tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's tensors by flat key, read on one process."""
    out = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)

    def flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        found = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                found.update(flat(value, f"{prefix}{key}."))
            elif isinstance(value, torch.Tensor):
                found[f"{prefix}{key}"] = value
        return found

    return flat(torch.load(out, weights_only=False))


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every step the run recorded, those of restarts that started over included."""
    files = [*sorted(run_dir.glob("metrics.attempt*.jsonl")), run_dir / "metrics.jsonl"]
    records = [json.loads(line) for path in files for line in path.read_text().splitlines()]
    return [(record["step"], record["loss"]) for record in records]


def judge(job: Job, reference: Job, thrown: list[Thrown], scratch: Path) -> list[str]:
    """Every way the soaked run differs from the reference or lost what it had; [] when it passed."""
    problems = []
    status = json.loads((job.run_dir / "status.json").read_text())
    if status.get("state") != "finished" or status.get("step") != job.steps:
        problems.append(f"status.json says {status.get('state')} at step {status.get('step')}")
    final, expected = step_dir(job.checkpoint_root, job.steps), step_dir(reference.checkpoint_root, job.steps)
    ours, theirs = tensors(final, scratch), tensors(expected, scratch)
    differ = sorted(key for key in theirs.keys() | ours.keys()
                    if key not in ours or key not in theirs or not torch.equal(ours[key], theirs[key]))
    if differ:
        problems.append(f"{len(differ)} of {len(theirs)} tensors of {final.name} differ from the uninterrupted "
                        f"run's: {', '.join(differ[:5])}")
    expected_loss = dict(losses(reference.run_dir))
    wrong = [step for step, loss in losses(job.run_dir) if expected_loss.get(step) != loss]
    if wrong:
        problems.append(f"{len(wrong)} recorded steps have another loss than the uninterrupted run's: steps "
                        f"{sorted(set(wrong))[:10]}")
    for name in sorted(job.verified - job.damaged):
        if found := verify(job.checkpoint_root / name):
            problems.append(f"{name}, verified after an attempt, no longer does: {found[0]}")
    for log in sorted(job.logs.iterdir()):
        if "Traceback (most recent call last)" in log.read_text():
            problems.append(f"{log} holds a traceback: a fault was not said in a line of ours")
    for fault in thrown:
        output = fault.details.get("output")
        logs = [Path(output)] if output else fault.logs
        text = "\n".join(log.read_text() for log in logs)
        fault.line = line_naming(fault.kind, fault.details, text)
        if fault.line is None:
            problems.append(f"{fault.kind.name} at {fault.where}: no line of ours names it (looked in "
                            f"{', '.join(map(str, logs))})")
        if fault.kind.verdict and not re.search(fault.kind.verdict, text):
            problems.append(f"{fault.kind.name} at {fault.where}: the job script did not say "
                            f"{fault.kind.verdict!r}")
        if output and (code := job.hand_launches[output].returncode) != 78:
            problems.append(f"{fault.kind.name} at {fault.where}: exit {code}, not 78")
    return problems


class TmpfsUnavailableError(RuntimeError):
    """The checkpoint file system cannot be mounted here (not root, or no mount)."""


def mount_tmpfs(path: Path, megabytes: int) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        raise TmpfsUnavailableError(f"the soak's checkpoints need a tmpfs of their own (a full disk and a read-only "
                                    f"mount are two of its faults); mount said: {done.stderr.strip()}")


def soak(root: Path, steps: int, every: int, total: int, procs: int, seed: int) -> SoakResult:
    """The reference job, then the soaked one (its checkpoints on a tmpfs sized for all of them); the result."""
    started = time.time()
    reference = Job(root / "reference", steps, every, procs)
    during(reference, AttemptPlan(), random.Random(seed))
    last = step_dir(reference.checkpoint_root, steps)
    checkpoint_bytes = sum(f.stat().st_size for f in last.iterdir())
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors(last, root).values())
    file_system = root / "checkpoint-fs"
    # Room for every checkpoint kept: one every `every` steps, and at most one more a fault (a preemption's save, a
    # damaged one moved aside), so that only the ballast ever fills it.
    mount_tmpfs(file_system, int(checkpoint_bytes * (steps // every + total + 4) / 2**20) + 8)
    try:
        soaked_at = time.time()
        job = Job(root / "soak", steps, every, procs, file_system, checkpoint_bytes, tensor_bytes)
        rng = random.Random(seed)
        plans = schedule(rng, kinds(procs), total, steps, every, max_restarts=3)
        try:
            thrown = run_job(job, plans, rng)
        finally:
            job.kill()
        wall_s = time.time() - soaked_at
        problems = judge(job, reference, thrown, root)
        steps_run = len(losses(job.run_dir))
    finally:
        subprocess.run(["umount", "--lazy", str(file_system)], capture_output=True)
    print(f"soak: reference {soaked_at - started:.0f} s, soak {wall_s:.0f} s", flush=True)
    return SoakResult(thrown, steps, steps_run, job.attempts, wall_s, problems)


def report(result: SoakResult) -> str:
    by_kind: dict[str, list[Thrown]] = {}
    for fault in result.thrown:
        by_kind.setdefault(fault.kind.name, []).append(fault)
    rows = ["| fault | count | line of ours (first) | verdict |", "| --- | --- | --- | --- |"]
    for name, faults in by_kind.items():
        named = sum(fault.line is not None for fault in faults)
        line = next((fault.line for fault in faults if fault.line), "(none)")
        line = re.sub(r"^\S+ \S+ \S+ \[rank \d+\] \w+ ", "", line)  # the log's time, host and level
        verdict = "survived, named" if named == len(faults) else f"{len(faults) - named} not named"
        rows.append(f"| {name} | {len(faults)} | `{line[:150]}` | {verdict} |")
    kept = f"{result.steps} steps kept / {result.steps_run} run = {result.steps / result.steps_run:.1%}"
    return "\n".join([*rows, "", f"faults: {len(result.thrown)} of {len(by_kind)} kinds; attempts: "
                      f"{len(result.attempts)} ({', '.join(result.attempts)}); effective training time: {kept}; "
                      f"soak wall time {result.wall_s:.0f} s",
                      *(f"PROBLEM: {problem}" for problem in result.problems),
                      "PASSED" if not result.problems else "FAILED"])


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/soak.py", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every")
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="kept after the run (default: a temporary one)")
    args = parser.parse_args()
    if args.faults < len(kinds(args.procs)):
        parser.error(f"--faults {args.faults}: every one of the {len(kinds(args.procs))} kinds is thrown at least once")
    root = args.dir or Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"soak: {args.faults} faults, {args.steps} steps, {args.procs} ranks, seed {args.seed}, in {root} "
          f"(host {socket.gethostname()})", flush=True)
    try:
        result = soak(root, args.steps, args.every, args.faults, args.procs, args.seed)
    except (SoakError, TmpfsUnavailableError) as err:
        print(f"soak: {err}", file=sys.stderr)
        return 1
    print(report(result))
    if args.dir is None and not result.problems:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not result.problems else 1


if __name__ == "__main__":
    sys.exit(main())
