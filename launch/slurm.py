"""SLURM jobs: render an sbatch script for a config, or submit it.

    python -m launch.slurm render [CONFIG] [--config MORE ...] --nodes N --gpus-per-node G --time HH:MM:SS
        [--partition P] [--account A] [--extra-sbatch=--qos=high ...] [--procs-per-node K] [overrides ...]
    python -m launch.slurm submit ... [--dry-run]        # prints the job id (dry run: only the script)

Configs and overrides are taken as by every command (moe_pretrain/config/cli.py).

The script runs one `srun` task per node, each a torchrun joining a c10d rendezvous on the first node (bound to
its GPUs' NUMA nodes by torchrun --numa-binding). It asks SLURM for the preemption signal the signal lead before
the time limit (--signal=B:...; the lead derived from the largest rank's checkpoint, launch/signal_lead.py), and
gives the training processes the same moment as a clock time to stop by (MOE_PRETRAIN_STOP_AT, from the job's end
time): either way they save and exit as preempted. The signal is forwarded (also on SIGTERM, which a preemption
with GraceTime or `scancel --signal=TERM` sends the batch shell: srun would take a SIGTERM of its own as
"terminate the step") through srun and torchrun to the training processes. What follows the run (requeue, exit,
or the node check and exclusion of sick nodes) is launch/slurm_outcome.py. srun gets the CPUs per task (SLURM
22.05-23.02 do not pass sbatch's on) and --wait, so one node's torchrun dying ends the others after the lead
instead of leaving them in the rendezvous. The layout is checked for nodes x processes per node as training
checks it, before anything is rendered.

Every value that reaches the shell is quoted with shlex.quote; values that go into #SBATCH lines (which
sbatch parses itself) must be plain tokens and are otherwise refused.
"""

import argparse
import hashlib
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launch.signal_lead import signal_lead
from launch.slurm_outcome import outcome_lines
from moe_pretrain.config import EX_CONFIG, Config, ConfigError, LaunchConfig, add_config_arguments, load_config
from moe_pretrain.config.cli import config_sources
from moe_pretrain.operations.outcome import LAUNCH_ID_VARIABLE
from moe_pretrain.operations.preemption import STOP_AT_VARIABLE
from moe_pretrain.operations.watchdog import FR_TRACE_PREFIX
from parallel.state import resolve_layout

SBATCH_TOKEN = re.compile(r"^[A-Za-z0-9_.,:=/@+%-]+$")
TIME = re.compile(r"^(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})$")
MAX_SIGNAL_LEAD_S = 65535
"""SLURM's --signal takes at most this many seconds."""
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
FR_TRACE_ENTRIES = 20000


@dataclass
class JobRequest:
    configs: list[str]
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    time: str
    procs_per_node: int = 0
    """Training processes per node; 0 = gpus_per_node (set it for CPU-only jobs)."""
    partition: str = ""
    account: str = ""
    job_name: str = ""
    """Default: moe-<run_dir's name>-<8 hex of its absolute path> (job_name_of): with --dependency=singleton one
    job per run directory runs at a time, so a second submission waits instead of writing beside the first."""
    extra_sbatch: list[str] = field(default_factory=list)
    workdir: str = "."


def _header_value(option: str, value: str) -> str:
    if not SBATCH_TOKEN.match(value):
        raise ValueError(f"{option}={value!r}: only letters, digits and _.,:=/@+%- may go into an #SBATCH line")
    return value


def _extra(option: str) -> str:
    if not option.startswith("--") or not SBATCH_TOKEN.match(option):
        raise ValueError(f"--extra-sbatch {option!r}: give one long option as --name=value, made of plain characters")
    return option


def time_limit_s(text: str) -> int:
    """--time's HH:MM:SS or D-HH:MM:SS in seconds."""
    match = TIME.match(text)
    if not match:
        raise ValueError(f"--time={text!r} must be HH:MM:SS or D-HH:MM:SS")
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return ((24 * days + hours) * 60 + minutes) * 60 + seconds


def default_environment(cpus: int, procs: int) -> dict[str, str]:
    """What every job sets before launch.env (which may override any of it): the flight recorder, the shutdown
    time, threads per rank, and settings every NCCL cluster wants; the fabric's own (NCCL_IB_HCA,
    NCCL_SOCKET_IFNAME, ...) come from launch.env, e.g. configs/clusters/infiniband.yaml."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",   # a failed collective aborts the process instead of hanging
        # NCCL's flight recorder keeps the last FR_TRACE_ENTRIES collectives of every rank (it records
        # nothing with a buffer of 0, the default) and, on a collective timeout or when the watchdog fires,
        # dumps them beside the watchdog's stack dumps: <run_dir>/hang/nccl_trace_rank_<rank>.
        "TORCH_FR_BUFFER_SIZE": str(FR_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "OMP_NUM_THREADS": str(max(1, cpus // procs)),
        # Tensors of asynchronous collectives are kept alive by the process group, not by allocator record_stream
        # (which holds their memory until a later sync): lower peak memory, megatron-core's setting.
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        # Triton's compiled kernels on the node's own disk: the default under $HOME is the shared file system,
        # where thousands of ranks compiling at once contend and can read each other's half-written files.
        "TRITON_CACHE_DIR": "/tmp/moe-pretrain-triton-cache",
    }


def job_name_of(run_dir: Path, workdir: str) -> str:
    """The job's name from its run directory: one name per directory (--dependency=singleton serialises its jobs)."""
    path = (Path(workdir) / run_dir).resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:40]
    return f"moe-{name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def join_timeout_s(nodes: int) -> int:
    """How long torchrun waits for every node to join the rendezvous: c10d's default 600 s plus 2 s a node, as a
    large allocation's nodes start over minutes (image pulls, file-system mounts): 4 nodes 608 s, 512 nodes 1624 s."""
    return 600 + 2 * nodes


def container_flags(launch: LaunchConfig, workdir: str) -> str:
    """pyxis / enroot options of the srun line (quoted: an image may hold `#`), '' without a container."""
    if not launch.container_image:
        return ""
    q = shlex.quote
    flags = [f"--container-image={q(launch.container_image)}",
             f"--container-workdir={q(launch.container_workdir or str(Path(workdir).resolve()))}"]
    if launch.container_mounts:
        flags.append(f"--container-mounts={q(launch.container_mounts)}")
    if not launch.container_mount_home:
        flags.append("--no-container-mount-home")
    return " ".join(flags) + " "


def render(request: JobRequest, cfg: Config) -> str:
    """The sbatch script (text). Raises ValueError for anything that cannot be put in it safely."""
    launch, q = cfg.launch, shlex.quote
    if request.nodes < 1 or request.gpus_per_node < 0:
        raise ValueError("--nodes must be >= 1 and --gpus-per-node >= 0")
    procs = request.procs_per_node or request.gpus_per_node
    if procs < 1:
        raise ValueError("--procs-per-node is needed when --gpus-per-node is 0 (a CPU job)")
    limit_s = time_limit_s(request.time)
    cpus = launch.cpus_per_task or (8 * request.gpus_per_node if request.gpus_per_node else procs)
    # ConfigError naming the key: refused now, not after the queue.
    lead = signal_lead(cfg, resolve_layout(cfg, request.nodes * procs))
    if lead.seconds >= limit_s:
        raise ValueError(f"the signal lead of {lead.seconds} s ({lead.why}) leaves no time to train within "
                         f"--time={request.time}")
    if lead.seconds > MAX_SIGNAL_LEAD_S:
        raise ValueError(f"the signal lead of {lead.seconds} s ({lead.why}) is more than SLURM's --signal takes "
                         f"({MAX_SIGNAL_LEAD_S} s): raise checkpoint.io_floor_mb_s to what the storage delivers")
    run_dir = Path(cfg.train.run_dir)
    header = [
        f"--job-name={_header_value('--job-name', request.job_name or job_name_of(run_dir, request.workdir))}",
        "--dependency=singleton",
        f"--chdir={_header_value('working directory', str(Path(request.workdir).resolve()))}",
        f"--nodes={request.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus}",
        f"--time={request.time}",
        f"--output={_header_value('train.run_dir', str(run_dir))}/slurm-%j.out",  # run_dir exists: submit makes it
        "--requeue",
        "--open-mode=append",
        f"--signal=B:{launch.signal}@{lead.seconds}",
    ]
    if launch.exclusive:
        header += ["--exclusive", "--mem=0"]
    if request.gpus_per_node:
        header.append(f"--gpus-per-node={request.gpus_per_node}")
    if request.partition:
        header.append(f"--partition={_header_value('--partition', request.partition)}")
    if request.account:
        header.append(f"--account={_header_value('--account', request.account)}")
    header += [_extra(option) for option in request.extra_sbatch]
    hang_dir = Path(request.workdir).resolve() / run_dir / "hang"
    environment = {
        **default_environment(cpus, procs),
        "TORCH_FR_DUMP_TEMP_FILE": str(hang_dir / FR_TRACE_PREFIX),
        # How long torchrun lets the workers save after forwarding the signal, before SIGKILL. The variable,
        # not torchrun's shutdown-timeout flag: torch < 2.11 has none (it would refuse to start) and ignores the
        # variable, keeping its 30 s (too short for a full-size save; docs/operations.md).
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(lead.seconds),
        **launch.env,
    }
    port = str(launch.rdzv_port) if launch.rdzv_port else "$((20000 + SLURM_JOB_ID % 20000))"
    signals = list(dict.fromkeys([launch.signal, "TERM"]))
    train_args = " ".join(q(arg) for config in request.configs for arg in ("--config", config))
    train_args += "".join(" " + q(override) for override in request.overrides)
    numa = f"--numa-binding={launch.numa_binding} " if request.gpus_per_node and launch.numa_binding != "off" else ""
    container = container_flags(launch, request.workdir)
    torchrun = (f"{q(launch.python)} -m launch.torchrun --nnodes={request.nodes} --nproc-per-node={procs} "
                f"--rdzv-backend=c10d --rdzv-id=\"$SLURM_JOB_ID\" --rdzv-endpoint=\"$head:$port\" "
                f"--rdzv-conf=join_timeout={join_timeout_s(request.nodes)} "
                f"--max-restarts={launch.max_restarts} {numa}--signals-to-handle={TORCHRUN_SIGNALS},SIG{launch.signal} "
                f"-m launch.train {train_args}")
    lines = ["#!/bin/bash", *(f"#SBATCH {h}" for h in header), "",
             "# Rendered by python -m launch.slurm; every shell value below is quoted.",
             "set -uo pipefail",
             f"cd {q(str(Path(request.workdir).resolve()))}",
             *(f"export {name}={q(value)}" for name, value in environment.items()),
             f"run_dir={q(str(run_dir))}",
             'mkdir -p "$run_dir"',
             f"mkdir -p {q(str(hang_dir))}",
             'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"port={port}",
             'echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST (rendezvous on '
             '$head:$port)"',
             'rm -f "$run_dir/status.json" "$run_dir/refused.json"  # written again by this run: its end, or a refusal',
             "# This run's records carry its launch id; the outcome reads only those (a launch by hand beside it",
             "# writes its own refusal, which must not decide this job).",
             f'export {LAUNCH_ID_VARIABLE}="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"',
             "# The run also stops by the clock, the lead before the job's end (squeue's, which follows a changed",
             "# time limit; else from --time): should SLURM's signal come late or not at all, it still saves in time.",
             'end=$(SLURM_TIME_FORMAT=standard squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | head -n 1)',
             'case "$end" in [0-9]*) end=$(date -d "$end" +%s 2>/dev/null) || end= ;; *) end= ;; esac',
             f'[ -n "$end" ] || end=$(( $(date +%s) + {limit_s} ))',
             f"export {STOP_AT_VARIABLE}=$((end - {lead.seconds}))",
             f'echo "job $SLURM_JOB_ID: training stops to save by $(date -d @${STOP_AT_VARIABLE} "+%F %T"), '
             f'{lead.seconds} s before the time limit ({lead.why})"',
             "srun_pid=",
             "# srun treats a SIGTERM of its own as 'terminate the step' (the tasks are killed after KillWait):",
             f"# whichever signal the script gets, srun is sent SIG{launch.signal}, which it passes to the tasks.",
             "forward() {",
             '  [ -n "$srun_pid" ] || return 0  # training has ended: the requeue\'s own SIGTERM, say',
             f'  echo "job $SLURM_JOB_ID: SIG$1 received, forwarding SIG{launch.signal} to the training processes"',
             f'  kill -s {launch.signal} "$srun_pid"',
             "}",
             *(f"trap 'forward {name}' {name}" for name in signals),
             "# --label: every line of the job log starts with its node's task number (the header line maps them).",
             f"srun --label --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=0 "
             f"--wait={lead.seconds} {container}{torchrun} &",
             "srun_pid=$!",
             "# wait returns early when the trap runs: keep waiting until srun has really ended.",
             'while true; do wait "$srun_pid"; code=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
             "srun_pid=",
             *outcome_lines(launch, request.gpus_per_node, Path(request.workdir).resolve() / run_dir, container),
             ""]
    return "\n".join(lines)


class SbatchNotFoundError(RuntimeError):
    """SLURM's sbatch is not on PATH (not a SLURM login node, or its module is not loaded)."""


def submit(script: str, run_dir: Path) -> str:
    """Write the script into the run directory (kept beside the run) and sbatch it; -> the job id."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.sbatch"
    path.write_text(script)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SbatchNotFoundError(
            f"SLURM's sbatch was not found on PATH, so nothing was submitted; the script is in {path} (submit it "
            "with `sbatch` where SLURM is installed; `python -m launch.slurm render ...` prints it without submitting)")
    done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["render", "submit"])
    add_config_arguments(parser)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--procs-per-node", type=int, default=0, help="default: --gpus-per-node (CPU jobs: set it)")
    parser.add_argument("--time", required=True, help="HH:MM:SS or D-HH:MM:SS")
    parser.add_argument("--partition", default="")
    parser.add_argument("--account", default="")
    parser.add_argument("--job-name", default="", help="default: from the run directory (one job per directory)")
    parser.add_argument("--extra-sbatch", action="append", default=[], help="one extra option, --name=value")
    parser.add_argument("--dry-run", action="store_true", help="submit: print the script, do not run sbatch")
    args = parser.parse_intermixed_args(argv)
    try:
        configs, overrides = config_sources(args)
        cfg = load_config(configs, overrides)
    except ConfigError as err:
        print(f"launch.slurm: config error: {err}", file=sys.stderr)
        return EX_CONFIG
    try:
        request = JobRequest(configs, overrides, args.nodes, args.gpus_per_node, args.time, args.procs_per_node,
                             args.partition, args.account, args.job_name, args.extra_sbatch)
        script = render(request, cfg)
    except ConfigError as err:  # the layout cannot run on these nodes: said now, not after the queue
        print(f"launch.slurm: config error: {err}", file=sys.stderr)
        return EX_CONFIG
    except ValueError as err:
        print(f"launch.slurm: {err}", file=sys.stderr)
        return 2
    if args.action == "render" or args.dry_run:
        print(script, end="")
        return 0
    try:
        print(submit(script, Path(cfg.train.run_dir)))
    except SbatchNotFoundError as err:
        print(f"launch.slurm: {err}", file=sys.stderr)
        return 127
    except RuntimeError as err:
        print(f"launch.slurm: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
