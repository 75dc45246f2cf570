"""Pruning renames a dropped checkpoint out of the checkpoint namespace at once and deletes it in the
background: the commit never waits for a delete, and a crash mid-delete leaves nothing resume could pick."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from moe_pretrain.checkpoint import committed_checkpoints, find, pruning, save, wait_for_deletions
from moe_pretrain.checkpoint.directory import LATEST, being_deleted


def save_steps(root: Path, steps: range) -> None:
    for step in steps:
        tensors = {"w": torch.full((64, 64), float(step)), "b": torch.arange(16.0) + step}
        save(root, step, tensors, {"step": step}, {}, keep_last=2, keep_every=0)


def test_a_slow_delete_never_holds_up_the_commit(tmp_path, monkeypatch):
    release, started = threading.Event(), threading.Event()
    deleted = []

    def slow_delete(path):  # a parallel file system taking minutes: held until the test releases it
        started.set()
        release.wait(timeout=60)
        pruning.shutil.rmtree(path)
        deleted.append(path.name)

    monkeypatch.setattr(pruning, "delete_tree", slow_delete)
    root = tmp_path / "checkpoints"
    save_steps(root, range(1, 4))
    # save() returned (step 3 committed) while step 1's delete is still held.
    assert started.wait(timeout=30) and not release.is_set()
    assert [step for step, _ in committed_checkpoints(root)] == [3, 2]
    assert (root / LATEST).read_text().strip() == "step_00000003"
    [doomed] = being_deleted(root)
    assert doomed.name.startswith("step_00000001.") and (doomed / "manifest.json").is_file()
    assert find(root, "auto") == (root / "step_00000003", [])
    release.set()
    wait_for_deletions()
    assert deleted == [doomed.name] and being_deleted(root) == []


CRASH = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from moe_pretrain.checkpoint import pruning
    from tests.integration.test_checkpoint_pruning import save_steps

    def delete_then_die(path):  # the job is killed after the first file of the delete
        next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
        os.kill(os.getpid(), signal.SIGKILL)

    pruning.delete_tree = delete_then_die
    save_steps(Path(sys.argv[1]), range(1, 4))
    pruning.wait_for_deletions()
""")


@pytest.mark.timeout(120)
def test_a_crash_mid_delete_leaves_nothing_resume_could_pick(tmp_path):
    root = tmp_path / "checkpoints"
    done = subprocess.run([sys.executable, "-c", CRASH, str(root)], capture_output=True, text=True, timeout=100)
    assert done.returncode == -9, done.stderr[-2000:]
    [half] = being_deleted(root)
    assert half.name.startswith("step_00000001.") and any(half.iterdir())  # cut short: some files remain
    assert [step for step, _ in committed_checkpoints(root)] == [3, 2]
    assert find(root, "auto") == (root / "step_00000003", [])
    # The next prune (the next commit's, or the tool's) finishes what the crash left.
    assert pruning.prune(root, keep_last=2, background=False).dropped == []
    assert being_deleted(root) == [] and [step for step, _ in committed_checkpoints(root)] == [3, 2]
