"""Faults a run must survive, through the launcher (launch.train): a second run on one run directory, a resume
with a changed model, a run directory that is a file, directories that cannot be written, a full disk. A refused
launch exits 78 in one line and leaves the run's status.json as it was."""

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from launch import train as launcher
from launch import training_run
from moe_pretrain.checkpoint import committed_checkpoints
from moe_pretrain.operations.run_lock import LOCK, STALE_S, stale_reason
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import TINY, tiny_config

BASE = ["--config", "configs/smoke.yaml", *TINY, "train.dtype=float64", "logging.progress=false"]
STATUS = {"state": "preempted", "exit_code": 75, "step": 2, "message": "preempted by SIGUSR2 at step 2",
          "checkpoint": "ckpt"}


def launch(run_dir, *overrides) -> int:
    return launcher.main([*BASE, f"train.run_dir={run_dir}", *overrides])


def errors(capsys) -> list[str]:
    """The launcher's ERROR lines (its own handler writes to stderr), without the time and host prefix."""
    return [line.split("ERROR ", 1)[1] for line in capsys.readouterr().err.splitlines() if " ERROR " in line]


@pytest.fixture
def saved_run(tmp_path):
    """A run stopped at step 2 (checkpoints 1 and 2) whose status.json says so."""
    run_training(Trainer(tiny_config("train.steps=4", "train.exit_at_step=2", "checkpoint.every=1",
                                     "train.dtype=float64", "logging.progress=false", f"train.run_dir={tmp_path}")))
    (tmp_path / "status.json").write_text(json.dumps(STATUS))
    return tmp_path


@pytest.mark.parametrize(("override", "difference"), [
    ("model.hidden_size=48", "model.hidden_size: checkpoint 32, this run 48"),
    ("model.moe.num_experts=4", "model.moe.num_experts: checkpoint 8, this run 4"),
    ("model.num_layers=5 model.layer_pattern=KKMKK", "model.num_layers: checkpoint 6, this run 5"),
])
def test_a_changed_model_names_the_keys_and_touches_nothing(saved_run, capsys, override, difference):
    root = saved_run / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    code = launch(saved_run, "train.steps=4", *override.split())
    assert code == 78
    refusal = json.loads((saved_run / "refused.json").read_text())
    assert refusal["state"] == "refused" and difference in refusal["message"]
    assert "is intact but was saved by another model" in refusal["message"]
    assert errors(capsys) == [f"refused (rank 0): {refusal['message']}"]
    assert json.loads((saved_run / "status.json").read_text()) == STATUS  # the run's own status, as it was
    assert sorted(p.name for p in root.iterdir()) == before and (root / "latest").read_text().strip() == \
        "step_00000002"


def test_a_setting_that_changes_no_tensor_resumes(saved_run, capsys):
    """...and the closing line (and --require-loss-drop) measure from the run's first step, not the resume's."""
    first = json.loads((saved_run / "metrics.jsonl").read_text().splitlines()[0])
    assert launch(saved_run, "train.steps=3", "model.moe.qb_rate=0.5") == 0
    out = capsys.readouterr().out
    assert "model.moe.qb_rate: checkpoint 1.0, this run 0.5" in out
    assert f"first loss {first['loss']:.4f} (step 1)  last loss " in out
    assert json.loads((saved_run / "status.json").read_text())["state"] == "finished"


def test_a_run_directory_that_is_a_file_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.write_text("not a directory")
    monkeypatch.setattr(training_run, "Trainer", lambda *a: pytest.fail("the model was built"))
    assert launch(run_dir) == 78
    assert errors(capsys) == [f"refused (rank 0): train.run_dir={run_dir} is a file, not a directory"]


def test_a_config_error_is_reported_before_torch_is_imported(tmp_path):
    """The launcher used to import torch and megatron-core (seconds) before it read the config."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    probe = ("import sys; from launch.train import main; code = main(['--config', sys.argv[1]]); "
             "print(code, sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[-2] == "78 []", done.stdout + done.stderr
    assert f"config error (rank 0): config file {bad}, line 2, column 1: not valid YAML" in done.stderr


def test_a_lock_is_taken_over_only_from_a_holder_that_is_gone():
    host = socket.gethostname()
    alive = {"host": host, "pid": os.getppid(), "job": None}
    assert stale_reason(alive, 5.0, host, None) is None
    assert stale_reason({**alive, "host": "elsewhere"}, 5.0, host, None) is None
    assert "earlier attempt of this SLURM job 7" in stale_reason({**alive, "job": "7"}, 5.0, host, "7")
    assert stale_reason({**alive, "job": "7"}, 5.0, host, "8") is None
    assert "heartbeat stopped" in stale_reason({**alive, "host": "elsewhere"}, STALE_S + 1, host, None)
    with subprocess.Popen(["sleep", "0"]) as gone:
        gone.wait()
    assert "no longer runs on this host" in stale_reason({**alive, "pid": gone.pid}, 5.0, host, None)


@pytest.mark.timeout(240)
def test_a_second_run_on_a_live_run_directory_is_refused(tmp_path):
    """The issue's fault: the same command started twice on one run_dir. The second is refused in one line and
    the first finishes untouched; once the first is gone its lock no longer stands in the way."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "launch.train", *BASE, f"train.run_dir={run_dir}",
                              "train.steps=40", "checkpoint.every=10"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").exists():  # training has begun: the lock is held
            assert first.poll() is None and time.time() < deadline, "the first run did not start"
            time.sleep(0.2)
        assert launch(run_dir, "train.steps=40", "checkpoint.every=10") == 78
        refusal = json.loads((run_dir / "refused.json").read_text())["message"]
        assert refusal.startswith(f"train.run_dir={run_dir} is in use by another run (host {socket.gethostname()} "
                                  f"pid {first.pid}")
        assert not (run_dir / "metrics.attempt1.jsonl").exists()  # the live run's metrics were not renamed
        out, _ = first.communicate(timeout=200)
    finally:
        first.kill()
    assert first.returncode == 0, out
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert not (run_dir / LOCK).exists()  # released at exit
    assert next(step for step, _ in committed_checkpoints(run_dir / "checkpoints")) == 40
    assert launch(run_dir, "train.steps=40") == 0  # a relaunch of the finished run: nothing to do, exit 0


def mounted_tmpfs(tmp_path, name: str, options: str):
    """A tmpfs at tmp_path/name mounted with options, unmounted after the test (root can mount one; elsewhere the test
    says why it cannot run)."""
    mount = tmp_path / name
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs: room for one tiny checkpoint (about 2.2 MB), not two."""
    yield from mounted_tmpfs(tmp_path, "disk", "size=3m")


@pytest.fixture
def read_only_tmpfs(tmp_path):
    """A read-only tmpfs (root's permission bits would not stop root; a read-only mount does)."""
    yield from mounted_tmpfs(tmp_path, "read-only", "ro,size=1m")


def test_an_unwritable_checkpoint_dir_is_found_before_anything_is_built(tmp_path, read_only_tmpfs, monkeypatch,
                                                                         capsys):
    """Not at the first save, 30 minutes in at full size, as a traceback the job script would requeue."""
    run_dir, root = tmp_path / "run", read_only_tmpfs / "ckpt"
    monkeypatch.setattr(training_run, "Trainer", lambda *a: pytest.fail("the model was built"))
    assert launch(run_dir, f"checkpoint.dir={root}") == 78
    line = f"checkpoint.dir={root} cannot be written: Read-only file system (rank 0 on {socket.gethostname()})"
    assert errors(capsys) == [f"config error (rank 0): {line}"]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"], status["message"]) == ("failed", 78, f"config error: {line}")


def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(read_only_tmpfs, monkeypatch, capsys):
    monkeypatch.setattr(training_run, "Trainer", lambda *a: pytest.fail("the model was built"))
    assert launch(read_only_tmpfs) == 78
    assert errors(capsys) == [f"refused (rank 0): train.run_dir={read_only_tmpfs} cannot be written: Read-only "
                              "file system"]


def test_a_full_file_system_is_named_and_the_partial_save_removed(tmp_path, small_tmpfs, capsys):
    """Step 2's checkpoint fits in 3 MiB, step 4's does not beside it: exit 74 (storage_full) in one line naming
    ENOSPC and both figures, no partial directory left; once there is room, a relaunch resumes step 2."""
    run_dir, root = tmp_path / "run", small_tmpfs / "ckpt"
    args = (f"checkpoint.dir={root}", "train.steps=4", "checkpoint.every=2", "train.dtype=float32")
    assert launch(run_dir, *args) == 74
    [line] = errors(capsys)
    assert line.startswith(f"storage full (rank 0): checkpoint.dir={root} is full: ENOSPC, No space left on device: "
                           "the save needs ") and "free (checked before writing)" in line
    assert "step_00000004 was not saved and its partial step_00000004.tmp removed; the last checkpoint, " \
           "step_00000002, is intact" in line
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"], status["step"]) == ("storage_full", 74, 4)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)  # the operator frees space
    assert launch(run_dir, *args) == 0
    assert [step for step, _ in committed_checkpoints(root)] == [4, 2]


def test_a_failed_write_without_its_errno_is_still_named_when_the_disk_is_full(tmp_path, monkeypatch):
    """torch's zip writer reports a short write as 'unexpected pos', losing ENOSPC: the free space decides."""
    from moe_pretrain.checkpoint import storage_full

    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(storage_full, "free_bytes", lambda path: 4096)
    assert storage_full.full_cause(lost, tmp_path, 3).startswith("ENOSPC inferred: RuntimeError: [enforce fail")
    monkeypatch.setattr(storage_full, "free_bytes", lambda path: 10 * 2**30)
    assert storage_full.full_cause(lost, tmp_path, 3) is None
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/ckpt/x")
    assert storage_full.full_cause(RuntimeError("wrapped"), tmp_path, 3) is None
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = quota
    assert storage_full.full_cause(wrapped, tmp_path, 3) == "EDQUOT, Disk quota exceeded at /ckpt/x (rank 3)"
    monkeypatch.setattr(storage_full, "free_bytes", lambda path: 4096)  # a small read-only file system
    read_only = RuntimeError("write failed")
    read_only.__context__ = OSError(errno.EROFS, "Read-only file system", "/ckpt/x")
    assert storage_full.full_cause(read_only, tmp_path, 3) is None


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 128 KiB tmpfs."""
    yield from mounted_tmpfs(tmp_path, "tiny", "size=128k")


def test_a_disk_that_fills_midway_through_the_write_is_one_error_with_its_errno(tiny_tmpfs, monkeypatch):
    """400 tensors of 64 bytes plan 26 KB, which the free-space check passes on a 128 KiB file system; torch.save's
    per-item overhead makes the files several times that, so DCP's four writer threads fail midway. They used to
    print a traceback each (threading's excepthook) around the one line, and torch's zip writer's `unexpected pos`
    hid the ENOSPC from the other ranks; now the save raises once, with the errno."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from moe_pretrain.checkpoint.hashing_writer import HashingFileSystemWriter
    from moe_pretrain.checkpoint.storage_full import full_cause

    thread_failures = []
    monkeypatch.setattr(threading, "excepthook", thread_failures.append)
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(400)}
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        dcp.save(state, storage_writer=HashingFileSystemWriter(tiny_tmpfs / "ckpt", thread_count=4))
    assert thread_failures == []
    assert full_cause(raised.value, tiny_tmpfs, 0) == "ENOSPC, No space left on device (rank 0)"


def test_a_load_error_without_a_message_still_says_what_it_means():
    """A truncated shard's EOFError has no message: 'does not load (rank 0: EOFError: )' said nothing."""
    from moe_pretrain.checkpoint.store import _describe

    assert _describe(EOFError(), 0) == ["rank 0: EOFError (a file ends before its data)"]
    assert _describe(RuntimeError(), 3) == ["rank 3: RuntimeError (without a message)"]
    assert _describe(OSError("bad shard"), 1) == ["rank 1: OSError: bad shard"]
