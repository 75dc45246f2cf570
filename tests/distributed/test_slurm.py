"""launch.slurm: quoting of everything put into the script, and real jobs on a single-node SLURM cluster:
a job that finishes and checkpoints, and one preempted mid-run that checkpoints, requeues itself, resumes
and ends at the same loss as the uninterrupted one."""

import json
import os
import signal as signal_module
import socket
import stat
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from launch.local import free_port
from launch.slurm import JobRequest, main, render, submit
from moe_pretrain.config import EX_CONFIG, load_config
from tests.helpers import final_loss, steps_done
from tests.models import TINY
from tests.slurm_cluster import Cluster, ClusterUnavailableError

HOSTILE = "$(touch {marker}); `touch {marker}` ' \" ; touch {marker} \n #SBATCH --wrap=x"


def training_step(body: str) -> str:
    """A stand-in srun that runs body for the training step only (not for the node check after it)."""
    return f'#!/bin/bash\ncase "$*" in *launch.torchrun*) {body} ;; esac\n'


ECHO_NODE1 = "#!/bin/bash\necho node1\n"
"""A stand-in scontrol for one node (the script asks it for the head node's name)."""


def stand_in_job(tmp_path: Path, programs: dict[str, str], *overrides: str, nodes: str = "node1",
                 workdir: str | None = None) -> tuple[Path, dict[str, str]]:
    """The smoke job's rendered script (working directory workdir, by default tmp_path) and the environment to run it
    in, with stand-ins for SLURM's programs ({name: script}) first on PATH, then /usr/bin:/bin only (no Python of
    ours)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in programs.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    job, cfg = request(*overrides, workdir=workdir or str(tmp_path))
    script = tmp_path / "job.sbatch"
    script.write_text(render(job, cfg))
    return script, {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodes}


def request(*overrides: str, **fields) -> tuple[JobRequest, object]:
    configs = ["configs/smoke.yaml"]
    values = dict(nodes=1, gpus_per_node=0, time="00:10:00", procs_per_node=2)
    values.update(fields)
    return JobRequest(configs, list(overrides), **values), load_config(configs, list(overrides))


@pytest.mark.parametrize(("field", "value"), [
    ("partition", "debug\n#SBATCH --wrap=rm"), ("account", "a b"), ("job_name", "$(x)"), ("time", "1:00:00;x"),
    ("extra_sbatch", ["--qos=high; touch x"]), ("extra_sbatch", ["-p debug"]),
])
def test_header_values_that_sbatch_would_misread_are_refused(field, value):
    job, cfg = request(**{field: value})
    with pytest.raises(ValueError, match=r"(only letters|must be HH:MM:SS|plain characters)"):
        render(job, cfg)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hostile_values_reach_the_training_command_intact(tmp_path):
    """Run the rendered script with stand-ins for srun and scontrol: the hostile strings arrive as single
    arguments / values and nothing they contain is executed."""
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(marker=marker)
    programs = {"srun": training_step(f'printf "%s\\n" "$@" > {tmp_path}/argv; env > {tmp_path}/env'),
                "scontrol": ECHO_NODE1}
    environment = "launch.env={NCCL_SOCKET_IFNAME: " + json.dumps(hostile) + "}"
    script, env = stand_in_job(tmp_path, programs, f"train.resume={hostile}", environment,
                               f"train.run_dir={tmp_path}/run")
    subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=50)
    argv = (tmp_path / "argv").read_text().split("\n")
    assert not marker.exists()
    assert f"train.resume={hostile.splitlines()[0]}" in argv  # printf splits only on the embedded newline
    assert f"NCCL_SOCKET_IFNAME={hostile.splitlines()[0]}" in (tmp_path / "env").read_text()
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in argv and "--rdzv-id=7" in argv


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_flight_recorder_records_and_dumps_beside_the_watchdog(tmp_path):
    """NCCL's flight recorder records nothing unless its buffer is > 0; its dumps land in run_dir/hang/."""
    programs = {"srun": training_step(f"env > {tmp_path}/env"), "scontrol": ECHO_NODE1}
    script, env = stand_in_job(tmp_path, programs, "train.run_dir=run")
    subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=50)
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert int(seen["TORCH_FR_BUFFER_SIZE"]) > 0 and seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/run/hang/nccl_trace_rank_"
    assert (tmp_path / "run" / "hang").is_dir()
    assert seen["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"  # the derived lead's floor: the smoke model saves fast


def test_a_four_by_eight_script_carries_the_multi_node_flags():
    """configs/full.yaml on 4 nodes x 8 GPUs (its lead given: the model's whole state on 32 GPUs could never be
    saved in 4 hours, see the next test), line by line: whole nodes, one job per run directory at a time, srun given
    the CPUs (SLURM 22.05-23.02 do not pass sbatch's on), --wait and --label (per-node lines), both signals trapped,
    the port from the job id, ranks bound to their GPUs' NUMA nodes, the clock stop exported, the cluster-wide NCCL
    and Triton settings and the example cluster config's fabric settings, no Python to read the state, the node
    check on every node before a failure requeue."""
    configs, overrides = ["configs/full.yaml", "configs/clusters/infiniband.yaml"], ["launch.signal_lead_s=600"]
    job, cfg = JobRequest(configs, overrides, 4, 8, "04:00:00"), load_config(configs, overrides)
    lines = render(job, cfg).splitlines()
    for expected in ("#SBATCH --nodes=4", "#SBATCH --cpus-per-task=64", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --signal=B:USR2@600",
                     "trap 'forward USR2' USR2", "trap 'forward TERM' TERM", "port=$((20000 + SLURM_JOB_ID % 20000))",
                     "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600", "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
                     "export TRITON_CACHE_DIR=/tmp/moe-pretrain-triton-cache", "export OMP_NUM_THREADS=8",
                     "[ -n \"$end\" ] || end=$(( $(date +%s) + 14400 ))", "export MOE_PRETRAIN_STOP_AT=$((end - 600))",
                     "export NCCL_IB_HCA=mlx5", "export GLOO_SOCKET_IFNAME=ib0",
                     "if [ \"$requeues\" -ge 3 ]; then", "  scontrol requeuehold \"$SLURM_JOB_ID\""):
        assert expected in lines, expected
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun.startswith("srun --label --ntasks-per-node=1 --cpus-per-task=64 --kill-on-bad-exit=0 --wait=600 ")
    name = next(line for line in lines if line.startswith("#SBATCH --job-name="))
    assert name.startswith("#SBATCH --job-name=moe-full-") and "#SBATCH --dependency=singleton" in lines
    assert "--nnodes=4 --nproc-per-node=8" in srun and '--rdzv-endpoint="$head:$port"' in srun
    assert "--rdzv-conf=join_timeout=608 " in srun  # c10d's 600 s, plus 2 s a node
    assert " --numa-binding=node " in srun
    reading = lines[lines.index("field() {"):lines.index("state=") + 3]  # the state read from this launch's records
    assert not any("python" in line for line in reading) and "sed" in reading[1], reading
    assert any(line.startswith('[ "$(field "$run_dir/status.json" launch)" = "$launch_id" ]') for line in reading)
    check = next(line for line in lines if line.startswith("timeout 300 srun "))
    assert "python -m launch.node_check --gpus=8 --dir=" in check and check.endswith('node_check "$checks"')


def test_the_signal_lead_follows_the_checkpoint_size():
    """launch.signal_lead_s=0 (default): one step's margin plus the largest rank's save at checkpoint.io_floor_mb_s.
    At full size on 2048 GPUs a rank writes at most 12.4 GB (the fp32 masters of its slices of the weights held in
    bf16, its other parameters, the Muon momenta): 240 + 124 s, rounded up to 420 s (the fixed 300 s would have cut
    that save short); a slower floor lengthens it; the same model on 4 x 8 GPUs could never save in 4 hours and
    is refused, naming the figures; the smoke model keeps the 300 s floor."""
    stages = ["configs/full.yaml", "configs/stages/full.yaml"]
    full = render(JobRequest(stages, [], 256, 8, "48:00:00"), load_config(stages))
    assert "#SBATCH --signal=B:USR2@420" in full.splitlines()
    assert "rank 512's 12.4 GB at checkpoint.io_floor_mb_s=100" in full
    slow = ["checkpoint.io_floor_mb_s=50"]
    assert "#SBATCH --signal=B:USR2@540" in render(JobRequest(stages, slow, 256, 8, "48:00:00"),
                                                    load_config(stages, slow)).splitlines()
    with pytest.raises(ValueError, match=r"signal lead of 116160 s .* leaves no time to train within --time=04:00:00"):
        render(JobRequest(["configs/full.yaml"], [], 4, 8, "04:00:00"), load_config("configs/full.yaml"))
    assert "#SBATCH --signal=B:USR2@300" in render(*request()).splitlines()


def test_containers_go_on_the_srun_line_only():
    """pyxis flags from the launch section on srun, quoted (an nvcr.io#... image holds a `#`), none at the sbatch
    level (pyxis there would wrap the script's own srun and scontrol); the home directory is left out."""
    job, cfg = request("launch.container_image=nvcr.io#nvidia/pytorch:25.12-py3",
                       "launch.container_mounts=/lustre:/lustre,/data:/data", workdir="/lustre/moe")
    lines = render(job, cfg).splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert ("--container-image='nvcr.io#nvidia/pytorch:25.12-py3' --container-workdir=/lustre/moe "
            "--container-mounts=/lustre:/lustre,/data:/data --no-container-mount-home python -m launch.torchrun"
            ) in srun
    assert not [line for line in lines if line.startswith("#SBATCH") and "container" in line]
    assert "--container" not in next(line for line in render(*request()).splitlines() if line.startswith("srun "))


def test_a_layout_the_nodes_cannot_hold_is_refused_at_render(capsys):
    assert main(["render", "configs/full.yaml", "--nodes", "4", "--gpus-per-node", "8", "--time", "04:00:00",
                 "parallel.tp=3"]) == EX_CONFIG
    err = capsys.readouterr().err
    assert "world size 32 is not divisible by parallel.tp" in err and "Traceback" not in err


STAND_IN_SRUN = """#!/bin/bash
on_signal() {
  echo "srun got $1" > TMP/signal
  mkdir -p RUN
  STATUS
  exit 75
}
trap 'on_signal USR2' USR2
touch TMP/started
while true; do sleep 0.1; done
"""
"""srun as the workers answer a preemption signal: status.json says preempted, exit 75."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signal", ["USR2", "TERM"])
def test_the_script_forwards_the_signal_and_requeues_without_python(tmp_path, signal):
    """Stand-ins for srun (records the signal it is forwarded, then writes status.json as the workers would) and
    scontrol (records its arguments); launch.python names no interpreter at all: the state is read by the shell,
    and the job requeues itself, after SIGUSR2 (the time-limit signal) or SIGTERM (GraceTime preemption, which
    reaches srun as SIGUSR2)."""
    run_dir = tmp_path / "run"
    stand_in = STAND_IN_SRUN.replace("STATUS", record("status.json", "preempted"))
    programs = {"srun": stand_in.replace("TMP", str(tmp_path)).replace("RUN", str(run_dir)),
                "scontrol": f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol\necho node1\n'}
    script, env = stand_in_job(tmp_path, programs, f"train.run_dir={run_dir}", "launch.python=/nonexistent/python")
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.time() + 30
    while not (tmp_path / "started").exists():
        assert time.time() < deadline and shell.poll() is None, "the stand-in srun did not start"
        time.sleep(0.1)
    shell.send_signal(getattr(signal_module, f"SIG{signal}"))
    out, _ = shell.communicate(timeout=30)
    assert shell.returncode == 0, out
    assert (tmp_path / "signal").read_text().strip() == "srun got USR2"  # srun would end the step on a TERM
    assert "requeue 7" in (tmp_path / "scontrol").read_text()
    assert f"SIG{signal} received, forwarding SIGUSR2" in out and "training ended with state preempted" in out


CHECKING_SRUN = """#!/bin/bash
case "$*" in
  *launch.torchrun*) exit 1 ;;  # the run crashes: no status
  *) for fit in FIT; do touch "${@: -1}/$fit"; done; echo "$*" > TMP/check ;;  # the node check, per node
esac
"""
"""srun as a crashed run, then as the node check that finds the FIT nodes fit (the check directory is its last
argument)."""


HOLDING_SCONTROL = """#!/bin/bash
echo "$@" >> TMP/scontrol
case "$*" in
  "show hostnames node[1-3]") printf "node1\\nnode2\\nnode3\\n" ;;
  "show hostnames"*) printf "%s\\n" ${3//,/ } ;;
  "show job"*) echo "JobId=7 ExcNodeList=$(cat TMP/held 2>/dev/null || echo '(null)') Restarts=0" ;;
  "update JobId=7 ExcNodeList="*) [ -e TMP/refused ] || { touch TMP/refused; exit 1; }
                                  echo "${3#ExcNodeList=}" > TMP/held ;;
esac
"""
"""scontrol for three nodes: records its arguments, holds the job's ExcNodeList, and refuses its first update as
slurmctld does while the job still runs."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fit", "excluded"), [("node2 node3", "node1"), ("", "")], ids=["one-sick", "all-failing"])
def test_a_crashed_run_excludes_the_nodes_that_fail_the_check(tmp_path, fit, excluded):
    """Three nodes; stand-ins for srun (see CHECKING_SRUN) and scontrol (records its arguments, holds the job's
    ExcNodeList, refuses its first update as slurmctld does while the job still runs): one failing node is
    excluded (requeuehold, ExcNodeList retried until read back, release); all three failing is a shared cause,
    and the job requeues as it is."""
    programs = {"srun": CHECKING_SRUN.replace("TMP", str(tmp_path)).replace("FIT", fit),
                "scontrol": HOLDING_SCONTROL.replace("TMP", str(tmp_path))}
    script, env = stand_in_job(tmp_path, programs, f"train.run_dir={tmp_path}/run", nodes="node[1-3]")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tmp_path / "scontrol").read_text().splitlines()
    assert "python -m launch.node_check --gpus=0" in (tmp_path / "check").read_text()
    if excluded:
        changes = [call for call in calls if not call.startswith("show")]
        update = f"update JobId=7 ExcNodeList={excluded}"
        assert changes[-4:] == ["requeuehold 7", update, update, "release 7"], calls  # refused once, then held
        assert f"excluding {excluded} (failed the node check or did not answer)" in done.stdout
        assert f"released with ExcNodeList={excluded}: it waits for other nodes" in done.stdout
    else:
        assert calls[-1] == "requeue 7" and not [call for call in calls if call.startswith("update")]
        assert "all 3 nodes failed the node check: a shared cause, no node excluded" in done.stdout
        assert "every node passed" not in done.stdout
    assert (tmp_path / "run" / "slurm-7.failures").read_text() == (
        f"restart 0: state unknown, srun exit 1, excluded: {excluded or 'none'}\n")


def record(file: str, state: str, this_launch: bool = True) -> str:
    """Shell writing RUN/<file> as a launch does: its state, and its launch id ($MOE_PRETRAIN_LAUNCH_ID, which the
    job script sets for its runs) or none (a launch by hand)."""
    value, argument = ('"%s"', ' "$MOE_PRETRAIN_LAUNCH_ID"') if this_launch else ("null", "")
    return f"""printf ' "state": "{state}",\\n "launch": {value},\\n'{argument} > RUN/{file}"""


PREEMPTED = f"{record('status.json', 'preempted')}; exit 75"
"""The training step as preempted workers end it."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refused", ["by hand", "this launch"])
def test_only_this_launchs_own_refusal_decides_the_job(tmp_path, refused):
    """A launch refused by hand beside the live run leaves refused.json in its run directory; the run is then
    preempted, and the job requeues as the run's own status says. The job's own launch refused exits 78."""
    run_dir = tmp_path / "run"
    body = (f"{record('refused.json', 'refused', this_launch=False)}; {PREEMPTED}" if refused == "by hand" else
            f"{record('refused.json', 'refused')}; exit 78")
    programs = {"srun": training_step(body.replace("RUN", str(run_dir))), "scontrol": HOLDING_SCONTROL.replace(
        "TMP", str(tmp_path))}
    script, env = stand_in_job(tmp_path, programs, f"train.run_dir={run_dir}")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=50)
    calls = (tmp_path / "scontrol").read_text().splitlines()
    if refused == "by hand":
        assert done.returncode == 0 and "requeue 7" in calls, done.stdout + done.stderr
        assert "job 7: training ended with state preempted (srun exit 75)" in done.stdout
    else:
        assert done.returncode == EX_CONFIG and "requeue 7" not in calls, done.stdout + done.stderr
        assert "job 7: launch refused, not requeued" in done.stdout


@pytest.mark.timeout(60)
def test_a_host_marked_slow_is_excluded_as_the_preempted_job_requeues(tmp_path):
    """logging.straggler.action=exclude marked node2 (RUN_DIR/slow_hosts, node9 not this job's); the run is
    preempted: the job requeues through the sick-node path's sequence (requeuehold, ExcNodeList retried until read
    back, release), without a node check and without counting a failed run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "slow_hosts").write_text("node9\nnode2\n")
    preempted = training_step(PREEMPTED.replace("RUN", str(run_dir)))
    programs = {"srun": preempted, "scontrol": HOLDING_SCONTROL.replace("TMP", str(tmp_path))}
    script, env = stand_in_job(tmp_path, programs, f"train.run_dir={run_dir}", nodes="node[1-3]")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    changes = [call for call in (tmp_path / "scontrol").read_text().splitlines() if not call.startswith("show")]
    update = "update JobId=7 ExcNodeList=node2"
    assert changes == ["requeuehold 7", update, update, "release 7"], changes
    assert "excluding node2 (marked slow by the straggler check)" in done.stdout
    assert "released with ExcNodeList=node2" in done.stdout
    assert not (run_dir / "slurm-7.failures").exists()


CLI = [sys.executable, "-m", "launch.slurm"]
JOB = ["--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "--time", "00:10:00"]


@pytest.mark.timeout(60)
def test_submit_without_sbatch_says_so_and_keeps_the_script(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = subprocess.run([*CLI, "submit", "--config", "configs/smoke.yaml", *JOB, f"train.run_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=50, env={**os.environ, "PATH": str(empty)})
    assert done.returncode == 127 and "Traceback" not in done.stderr
    assert "SLURM's sbatch was not found on PATH" in done.stderr and "render" in done.stderr
    assert (tmp_path / "run" / "job.sbatch").read_text().startswith("#!/bin/bash")


@pytest.mark.timeout(60)
def test_config_forms_are_those_of_every_command(capsys):
    """Positional CONFIG (as documented) and --config give the same script; overrides may come anywhere.
    (In process: the command line is parsed by main, as the module's entry point calls it.)"""
    assert main(["render", "configs/smoke.yaml", *JOB, "train.steps=7"]) == 0
    positional = capsys.readouterr().out
    assert main(["render", "train.steps=7", "--config", "configs/smoke.yaml", *JOB]) == 0
    flagged = capsys.readouterr().out
    assert positional == flagged and "train.steps=7" in positional


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        running = Cluster(tmp_path_factory.mktemp("slurm")).start()
    except ClusterUnavailableError as why:
        pytest.skip(str(why))
    yield running
    running.stop()


def job_overrides(run_dir: Path) -> list[str]:
    """A free rendezvous port of its own: under pytest-xdist two workers may each run a cluster whose job ids
    (and so the ports derived from them) coincide on this one machine."""
    return [*TINY, "train.steps=30", "logging.progress=false", f"train.run_dir={run_dir}",
            f"launch.python={sys.executable}", "launch.signal_lead_s=60", f"launch.rdzv_port={free_port()}"]


def start_job(cluster: Cluster, run_dir: Path, *overrides: str, procs_per_node: int = 2) -> str:
    job, cfg = request(*job_overrides(run_dir), *overrides, procs_per_node=procs_per_node)
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        return submit(render(job, cfg), run_dir)
    finally:
        del os.environ["SLURM_CONF"]


@pytest.fixture(scope="module")
def finished_job(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    job_id = start_job(cluster, run_dir)
    info = cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    return job_id, info, run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_job_runs_to_the_end_and_checkpoints(finished_job):
    job_id, info, run_dir = finished_job
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (run_dir / "checkpoints" / "step_00000030" / "manifest.json").exists()
    assert f"job {job_id}: training ended with state finished" in log
    # The clock stop is the job's end (its start + --time, as squeue reports it) less the lead.
    stop = datetime.fromisoformat(info["StartTime"]) + timedelta(seconds=600 - 60)
    assert (f"job {job_id}: training stops to save by {stop:%Y-%m-%d %H:%M:%S}, 60 s before the time limit "
            "(launch.signal_lead_s=60)") in log


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preempted_job_checkpoints_requeues_and_resumes(cluster, finished_job, tmp_path):
    """USR2 (the time limit's --signal=B:USR2) to the batch script: the script survives it and forwards USR2,
    the workers checkpoint, the job requeues itself, resumes and ends at the uninterrupted run's loss. (A TERM
    reaches the workers as the same USR2: test_the_script_forwards_the_signal_and_requeues_without_python
    holds the script's part for both signals.)"""
    signal = "USR2"
    run_dir = tmp_path / "run"
    job_id = start_job(cluster, run_dir)
    deadline = time.time() + 240
    while steps_done(run_dir) < 8:
        assert time.time() < deadline, "the job did not get going"
        time.sleep(0.5)
    subprocess.run(["scancel", f"--signal={signal}", "--batch", job_id], env=cluster.env, check=True)
    cluster.wait(job_id, {"PENDING"}, timeout=120)  # requeued by its own script
    # slurmctld holds a requeued job for 120 s (its BeginTime); release it sooner, as the rest is ours to test,
    # but not within the second of the requeue: slurmd revoked the first run's credential then, and refuses
    # ("Job credential revoked", the job FAILED) a new one issued in the same second, as its clock is in seconds.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
    info = cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{log[-3000:]}\n{cluster.log_tails()}"
    step = int(log.split("preempted by SIGUSR2 at step ")[1].split(";")[0])
    assert 8 <= step < 30
    assert f"job {job_id}: SIG{signal} received, forwarding SIGUSR2" in log
    assert f"job {job_id}: requeueing" in log and f"job {job_id} restart 1" in log
    assert f"resumed from {run_dir}/checkpoints/step_{step:08d} at step {step}" in log
    assert final_loss(run_dir) == pytest.approx(final_loss(finished_job[2]), rel=1e-6)
    print(f"job {job_id}: preempted at step {step}, requeued, resumed, finished; final loss {final_loss(run_dir)}")


HUNG_AT_ONCE = ["train.hang_timeout_s=0.001", "launch.max_restarts=0"]
"""Every step outlives the watchdog's absolute limit: the run ends hung (76) at its first step, and torchrun does
not restart it. One process per node, so rank 0's watchdog (the one that writes status.json) always fires."""


def wait_requeued(cluster: Cluster, job_id: str, timeout: float) -> dict[str, str]:
    """Wait until the job has run once and is pending again (a new job is PENDING before it first runs)."""
    deadline = time.time() + timeout
    while (info := cluster.job(job_id)).get("Restarts") != "1" or info.get("JobState") != "PENDING":
        assert time.time() < deadline, f"job {job_id} not requeued after {timeout} s: {info.get('JobState')}"
        time.sleep(1)
    return info


@pytest.mark.timeout(300)
def test_a_hung_run_excludes_the_node_that_fails_the_check_and_requeues(cluster, tmp_path):
    """The run hangs; the node check (here `/bin/false`: this node is sick) fails on the one node, which joins the job's
    ExcNodeList before the job requeues itself: it then waits for another node instead of meeting this one again."""
    run_dir = tmp_path / "run"
    job_id = start_job(cluster, run_dir, *HUNG_AT_ONCE, "launch.node_check=/bin/false", procs_per_node=1)
    wait_requeued(cluster, job_id, timeout=240)
    host, log_path = cluster.node, run_dir / f"slurm-{job_id}.out"
    released = f"job {job_id}: released with ExcNodeList={host}: it waits for other nodes"
    deadline = time.time() + 60
    while released not in (log := log_path.read_text()):
        assert time.time() < deadline, log[-3000:]
        time.sleep(0.5)
    info = cluster.job(job_id)
    try:
        assert f"job {job_id}: training ended with state hung" in log, log[-3000:]
        assert f"job {job_id}: excluding {host} (failed the node check or did not answer); ExcNodeList={host}" in log
        assert info["ExcNodeList"] == host and info["Restarts"] == "1", (info, cluster.log_tails())
        assert "requeueing after a failed run (1 of launch.max_requeues=3)" in log
        assert (run_dir / f"slurm-{job_id}.failures").read_text() == (
            f"restart 0: state hung, srun exit 76, excluded: {host}\n")  # launch.torchrun keeps the code
        assert "watchdog (rank 0 on" in (run_dir / "hang" / "rank0.txt").read_text()
    finally:
        subprocess.run(["scancel", job_id], env=cluster.env, check=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_failed_runs_requeue_at_most_max_requeues_times(cluster, tmp_path):
    """The real node check (launch/node_check.py) passes on this node: the hung run requeues without excluding
    it; the second hung run finds launch.max_requeues=1 used up and ends the job with the run's exit code."""
    run_dir = tmp_path / "run"
    job_id = start_job(cluster, run_dir, *HUNG_AT_ONCE, "launch.max_requeues=1", procs_per_node=1)
    wait_requeued(cluster, job_id, timeout=240)
    time.sleep(2)  # as in the preemption test: not within the second of the requeue
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
    info = cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", f"{log[-3000:]}\n{cluster.log_tails()}"
    assert f"node_check on {socket.gethostname()}: fit (0 GPUs, {run_dir} writable)" in log
    assert f"job {job_id}: every node passed the node check" in log
    assert info["ExcNodeList"] == "(null)"
    assert (f"job {job_id}: not requeued: 1 requeues after failed runs already (launch.max_requeues; see "
            f"{run_dir}/slurm-{job_id}.failures); left to a person") in log
