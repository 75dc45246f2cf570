"""Operations without SLURM: exit codes, the preemption signal, the hang watchdog, and a run whose
checkpoints all fail verification."""

import json
import os
import pickle
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from moe_pretrain.operations.outcome import HUNG, PERMANENT, REQUEUE
from tests.models import TINY
from tests.processes import TRAIN, signal_long_run, torchrun


@pytest.mark.timeout(240)
def test_preemption_signal_saves_and_exits_for_requeue(tmp_path):
    run_dir = tmp_path / "run"
    proc, out, err = signal_long_run([*TRAIN, "train.steps=400", f"train.run_dir={run_dir}"], run_dir, signal.SIGUSR2)
    assert proc.returncode == REQUEUE, err[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    step = status["step"]
    assert status["state"] == "preempted" and 3 <= step < 400 and "SIGUSR2" in status["message"]
    checkpoint = Path(status["checkpoint"])
    assert checkpoint.name == f"step_{step:08d}" and (checkpoint / "manifest.json").exists()
    assert f"preempted by SIGUSR2 at step {step}" in out


@pytest.mark.timeout(240)
def test_watchdog_dumps_stacks_and_names_the_stuck_rank(tmp_path):
    run_dir = tmp_path / "run"
    # The flight recorder on, as the SLURM job sets it: the watchdog dumps it too (gloo feeds torch's generic one).
    done = subprocess.run(torchrun("-m", "tests.hang_worker", "1", "5", "--config", "configs/smoke.yaml", *TINY,
                                   "logging.progress=false", "train.steps=50", "train.hang_multiple=5",
                                   "train.hang_min_s=3", f"train.run_dir={run_dir}"),
                          capture_output=True, text=True, timeout=200,
                          env={**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"})
    assert done.returncode != 0
    # The host in the message and in every log line: node ranks follow the order nodes joined the rendezvous.
    host = socket.gethostname()
    assert f"watchdog (rank 1 on {host}): step 5 has run" in done.stderr and f"exiting with code {HUNG}" in done.stderr
    assert f" {host} [rank 1] CRITICAL watchdog" in done.stderr
    dump = (run_dir / "hang" / "rank1.txt").read_text()
    assert dump.startswith(f"watchdog (rank 1 on {host})")
    assert "train.hang_multiple=5 x the median step" in dump
    assert "hang_worker.py" in dump and "train_step" in dump  # the stuck frame, from faulthandler
    trace = run_dir / "hang" / "nccl_trace_rank_1"
    assert f"the flight recorder's last collectives are in {trace}" in done.stderr
    entries = pickle.loads(trace.read_bytes())["entries"]
    # Gloo's recorder keeps each collective as scheduled (NCCL's also marks started / completed, which is what
    # torch's analyser compares across ranks): here, that rank 1's last steps' collectives were recorded by group.
    assert len(entries) > 4 and all(entry["profiling_name"].startswith("gloo:") for entry in entries)
    assert "EXPERT_DATA_PARALLEL_GROUP" in {entry["process_group"][1] for entry in entries}
    print(dump[:2000])


@pytest.mark.timeout(240)
def test_no_verifiable_checkpoint_is_a_permanent_failure(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.run([*TRAIN, "train.steps=4", "checkpoint.every=2", f"train.run_dir={run_dir}"],
                           capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stderr[-3000:]
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        shard = next(checkpoint.glob("*.distcp"))
        shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    again = subprocess.run([*TRAIN, "train.steps=6", "checkpoint.every=2", f"train.run_dir={run_dir}"],
                           capture_output=True, text=True, timeout=200)
    assert again.returncode == PERMANENT, again.stderr[-3000:]
    assert "no checkpoint in" in again.stderr and "verifies" in again.stderr and "not starting over" in again.stderr
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
