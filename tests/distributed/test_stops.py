"""How runs stop and start again: a relaunch of a finished run, Ctrl-C (SIGINT) on one process and under
torchrun, timed checkpoints agreed by all ranks, and the clock stop before a job's time limit."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_pretrain.config import CheckpointConfig, ConfigError
from moe_pretrain.operations.outcome import INTERRUPTED, REQUEUE
from moe_pretrain.operations.preemption import StopSignals, stop_at_from_env
from tests.helpers import steps_done
from tests.processes import TRAIN, signal_long_run, torchrun, wait_for_step


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.timeout(240)
def test_relaunching_a_finished_run_says_so_and_exits_0(tmp_path):
    """Also the timed checkpoint interval: 0.0001 minutes is due after every step (no step interval)."""
    run_dir = tmp_path / "run"
    args = [*TRAIN, "train.steps=3", "checkpoint.every=0", "checkpoint.every_minutes=0.0001",
            "checkpoint.keep_last=10", f"train.run_dir={run_dir}"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == [f"step_{s:08d}" for s in (1, 2, 3)]
    # Start-up says which fast paths are on, and megatron-core's import-time warnings are gone.
    assert re.search(r"fast paths: .*KDA: PyTorch chunk form", first.stdout) and "FP8: off" in first.stdout
    assert "Warning" not in first.stderr, first.stderr[-3000:]
    again = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run already finished at step 3 (train.steps=3); nothing to do" in again.stdout
    assert "Traceback" not in again.stderr
    assert status(run_dir)["state"] == "finished" and status(run_dir)["step"] == 3
    assert steps_done(run_dir) == 3  # nothing appended


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_relaunching_a_finished_pipeline_run_under_torchrun(tmp_path):
    """parallel.pp=2 alone (no data.micro_batches): the count is derived and said at start-up."""
    run_dir = tmp_path / "run"
    args = torchrun("-m", "launch.train", *TRAIN[3:], "parallel.pp=2", "train.steps=3", f"train.run_dir={run_dir}")
    first = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data.micro_batches=2 (the smallest count for parallel.pp=2: one round)" in first.stdout
    again = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run already finished at step 3" in again.stdout and "Traceback" not in again.stderr
    assert status(run_dir)["state"] == "finished"


@pytest.mark.timeout(300)
def test_ctrl_c_saves_exits_130_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc, out, err = signal_long_run([*TRAIN, "train.steps=400", f"train.run_dir={run_dir}"], run_dir, signal.SIGINT)
    assert proc.returncode == INTERRUPTED, err[-3000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    state = status(run_dir)
    step = state["step"]
    assert state["state"] == "interrupted" and state["exit_code"] == INTERRUPTED and 3 <= step < 400
    assert Path(state["checkpoint"]).name == f"step_{step:08d}"
    assert f"interrupted by SIGINT at step {step}" in out
    resumed = subprocess.run([*TRAIN, "train.steps=400", f"train.exit_at_step={step + 2}", f"train.run_dir={run_dir}"],
                             capture_output=True, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {state['checkpoint']} at step {step}" in resumed.stdout


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_exits_at_once(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "stderr.txt"
    # Long steps (seq_len 1024), so the second signal lands while the first one's step is still running.
    with log.open("w") as stderr:
        proc = subprocess.Popen([*TRAIN, "train.steps=400", "data.seq_len=1024", f"train.run_dir={run_dir}"],
                                stdout=subprocess.DEVNULL, stderr=stderr)
        wait_for_step(proc, run_dir, 2)
        proc.send_signal(signal.SIGINT)
        # Python merges signals that arrive before its handler runs: wait until the first was handled.
        deadline = time.time() + 30
        while "SIGINT: finishing this step" not in log.read_text():
            assert time.time() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == INTERRUPTED
    assert "second SIGINT: exiting at once" in log.read_text()
    assert not (run_dir / "status.json").exists()  # nothing was saved or written


@pytest.mark.timeout(300)
def test_ctrl_c_under_torchrun_checkpoints_on_every_rank(tmp_path):
    """torchrun forwards one SIGINT to its workers (they run in sessions of their own): they agree on a step,
    save it together and exit 130."""
    run_dir = tmp_path / "run"
    command = torchrun("-m", "launch.train", *TRAIN[3:], "train.steps=400", f"train.run_dir={run_dir}")
    proc, out, err = signal_long_run(command, run_dir, signal.SIGINT)
    assert proc.returncode != 0  # torchrun reports the signal it got
    state = status(run_dir)
    assert state["state"] == "interrupted", err[-3000:]
    checkpoint = Path(state["checkpoint"])
    assert (checkpoint / "manifest.json").exists() and checkpoint.name == f"step_{state['step']:08d}"
    assert f"exiting with {INTERRUPTED}" in out


def test_timed_checkpoints_are_on_by_default():
    assert CheckpointConfig().every_minutes == 30.0


def _agreement_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    signals = StopSignals()
    try:
        if rank == 1:
            signals.received = "SIGINT"
        # Only rank 0's clock says a timed save is due; only rank 1 got the signal.
        agreed = signals.agreed(True, torch.device("cpu"), save_due=rank == 0)
        results[rank] = (agreed.save_due, agreed.interrupted, agreed.signal_name)
    finally:
        signals.close()
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_every_rank_agrees_on_timed_saves_and_signals():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_agreement_worker, args=(port, results), nprocs=2, join=True)
    assert results[0] == (True, True, "SIGINT on another rank")
    assert results[1] == (True, True, "SIGINT")


def test_the_clock_stop_comes_before_a_step_that_would_end_past_it(monkeypatch):
    """MOE_PRETRAIN_STOP_AT (the job script's end time less the lead): a rank stops when the next step, as long
    as the last one, would end past it; a signal outranks it; a value that is no time is refused naming it."""
    signals = StopSignals(stop_at=time.time() + 100)
    try:
        assert signals.agreed(False, torch.device("cpu"), next_step_s=10).signal_name is None
        clock = signals.agreed(False, torch.device("cpu"), next_step_s=200)
        assert clock.signal_name.startswith("the job's time limit (MOE_PRETRAIN_STOP_AT: stop by ")
        assert not clock.interrupted
        signals.received = "SIGUSR2"
        assert signals.agreed(False, torch.device("cpu"), next_step_s=200).signal_name == "SIGUSR2"
    finally:
        signals.close()
    monkeypatch.setenv("MOE_PRETRAIN_STOP_AT", "tomorrow")
    with pytest.raises(ConfigError, match="MOE_PRETRAIN_STOP_AT='tomorrow' must be a time in unix seconds"):
        stop_at_from_env()


@pytest.mark.timeout(240)
def test_a_run_past_its_stop_time_saves_and_exits_for_requeue(tmp_path):
    """The clock stop end to end: a run whose stop time has passed saves after its first step and exits 75 with
    status preempted, as on the time limit's signal, so the job script requeues it."""
    run_dir = tmp_path / "run"
    done = subprocess.run([*TRAIN, "train.steps=50", f"train.run_dir={run_dir}"], capture_output=True, text=True,
                          timeout=200, env={**os.environ, "MOE_PRETRAIN_STOP_AT": str(time.time() - 1)})
    assert done.returncode == REQUEUE, done.stderr[-3000:]
    assert status(run_dir)["state"] == "preempted" and status(run_dir)["step"] == 1
    assert "preempted by the job's time limit (MOE_PRETRAIN_STOP_AT" in status(run_dir)["message"]
    assert (run_dir / "checkpoints" / "step_00000001" / "manifest.json").exists()
