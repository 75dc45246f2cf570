"""Fault injection on multi-process saves: a full disk, and a rank killed in each phase of a save.

Faults are injected by patching the storage layer inside the worker processes only. After every
fault, `latest` is unchanged and a resume picks the last complete checkpoint and continues exactly.
"""

import errno
import os
import signal

import pytest

from launch.local import run_distributed
from moe_pretrain.checkpoint import committed_checkpoints
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel
from tests.models import tiny_config

STEPS = 4


def config(run_dir, *overrides):
    return tiny_config(f"train.steps={STEPS}", "train.dtype=float64", "data.batch_size=8", "logging.progress=false",
                       "checkpoint.every=1", "checkpoint.keep_last=5", f"train.run_dir={run_dir}", *overrides)


def inject(phase: str, rank: int) -> None:
    """Make the second save (step 2) fail on `rank` in `phase`."""
    import torch.distributed.checkpoint.filesystem as fs

    from moe_pretrain.checkpoint import store

    saves = {"count": 0}

    def at_step_two():
        return saves["count"] == 2 and int(os.environ["RANK"]) == rank

    original_save, original_write = store.dcp.save, fs.FileSystemWriter.write_data
    original_manifest, original_durable = store.write_manifest, store.write_durably

    def counting_save(*args, **kwargs):
        saves["count"] += 1
        result = original_save(*args, **kwargs)
        if phase == "after_write" and at_step_two():
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def write_data(self, plan, planner):
        if at_step_two():
            if phase == "disk_full":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if phase == "during_write":
                os.kill(os.getpid(), signal.SIGKILL)
        return original_write(self, plan, planner)

    def manifest(*args, **kwargs):
        if phase == "before_manifest" and at_step_two():
            os.kill(os.getpid(), signal.SIGKILL)
        return original_manifest(*args, **kwargs)

    def durable(path, text):
        if phase == "before_latest" and at_step_two() and path.name == "latest":
            os.kill(os.getpid(), signal.SIGKILL)
        return original_durable(path, text)

    original_async = store.dcp.async_save

    def counting_async_save(*args, **kwargs):
        saves["count"] += 1
        return original_async(*args, **kwargs)

    store.dcp.save = counting_save
    store.dcp.async_save = counting_async_save
    fs.FileSystemWriter.write_data = write_data
    store.write_manifest = manifest
    store.write_durably = durable


def faulty_worker(rank, world_size, run_dir, phase, faulty_rank):
    cfg = config(run_dir, "parallel.ep=2")
    ctx = init_parallel(cfg)
    inject(phase, faulty_rank)
    try:
        run_training(Trainer(cfg, ctx))
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return [h["loss"] for h in run_training(Trainer(config(tmp_path_factory.mktemp("full") / "run")))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("phase", "faulty_rank", "committed", "error"), [
    ("disk_full", 1, [1], "is full: ENOSPC, No space left on device (injected) (rank 1). step_00000002 was not "
                          "saved and its partial step_00000002.tmp removed; the last checkpoint, step_00000001, is "
                          "intact"),
    ("during_write", 1, [1], None),
    ("after_write", 0, [1], None),
    ("before_manifest", 0, [1], None),
    ("before_latest", 0, [2, 1], None),  # step 2 is complete (manifest, renamed); only `latest` lags
])
def test_fault_during_save_then_resume(tmp_path, uninterrupted, phase, faulty_rank, committed, error):
    with pytest.raises(AssertionError) as failure:  # launch.local reports the workers' failures
        run_distributed(faulty_worker, 2, str(tmp_path), phase, faulty_rank, timeout=60)
    if error:
        assert error in str(failure.value)
    root = tmp_path / "checkpoints"
    assert [step for step, _ in committed_checkpoints(root)] == committed
    assert (root / "latest").read_text().strip() == "step_00000001"  # never advanced past a failed save
    # Resume on one process: the newest complete checkpoint, then exactly the uninterrupted losses.
    if error:
        assert not (root / "step_00000002.tmp").exists()  # removed by the failed save itself
    trainer = Trainer(config(tmp_path))
    resumed = [h["loss"] for h in run_training(trainer)]
    assert resumed == pytest.approx(uninterrupted[max(committed):], rel=1e-9)
    assert not (root / "step_00000002.tmp").exists()  # the partial save was cleaned up by the next one


def async_worker(rank, world_size, run_dir, fail_on_rank, policy):
    cfg = config(run_dir, "parallel.ep=2", "checkpoint.async_save=true", f"checkpoint.on_async_failure={policy}")
    ctx = init_parallel(cfg)
    if fail_on_rank >= 0:
        inject("disk_full", fail_on_rank)  # the background write of the step-2 save fails
    try:
        return [h["loss"] for h in run_training(Trainer(cfg, ctx))]
    finally:
        destroy_parallel()


@pytest.mark.timeout(240)
def test_async_saves_commit_and_resume_exactly(tmp_path, uninterrupted):
    losses = run_distributed(async_worker, 2, str(tmp_path), -1, "stop")
    assert losses == pytest.approx(uninterrupted, rel=1e-9)
    root = tmp_path / "checkpoints"
    assert [step for step, _ in committed_checkpoints(root)] == [4, 3, 2, 1]
    assert (root / "latest").read_text().strip() == "step_00000004"
    # Resume from the async-written step-2 checkpoint on one process: exact continuation.
    resumed = run_training(Trainer(config(tmp_path / "b", f"train.resume={root / 'step_00000002'}")))
    assert [h["loss"] for h in resumed] == pytest.approx(uninterrupted[2:], rel=1e-9)


@pytest.mark.timeout(240)
def test_failed_async_save_stops_every_rank(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_distributed(async_worker, 2, str(tmp_path), 1, "stop", timeout=60)
    message = str(failure.value)
    assert "rank 0:" in message and "rank 1:" in message  # raised on every rank
    assert "step_00000002 was not saved" in message and "ENOSPC, No space left on device (injected) (rank 1)" \
        in message
    root = tmp_path / "checkpoints"
    assert [step for step, _ in committed_checkpoints(root)] == [1]
    assert (root / "latest").read_text().strip() == "step_00000001"


@pytest.mark.timeout(240)
def test_failed_async_save_can_let_training_continue(tmp_path, uninterrupted):
    losses = run_distributed(async_worker, 2, str(tmp_path), 1, "continue")
    assert losses == pytest.approx(uninterrupted, rel=1e-9)  # training went on, unharmed
    assert [step for step, _ in committed_checkpoints(tmp_path / "checkpoints")] == [4, 3, 1]
