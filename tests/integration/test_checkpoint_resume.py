"""Checkpoints in one process: exact resume on the same layout, the files on disk, verification and fallback past a
damaged or partial checkpoint, retention, named and bad resume paths, a changed optimizer named, the RNG
restored."""

import json

import pytest
import torch

from moe_pretrain.checkpoint import CheckpointError, committed_checkpoints, verify
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.checkpoint_cases import STEPS, config, losses_of, uninterrupted_run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_run(tmp_path_factory.mktemp("full"))


def test_resume_is_bitwise_exact_on_the_same_layout(tmp_path, uninterrupted):
    first = losses_of(run_training(Trainer(config(tmp_path, "train.exit_at_step=3"))))
    resumed_trainer = Trainer(config(tmp_path))
    resumed = losses_of(run_training(resumed_trainer))
    assert first == uninterrupted[0][:3]
    assert resumed == uninterrupted[0][3:]  # bitwise: same floats, same order of operations
    for name, tensor in uninterrupted[1].items():
        assert torch.equal(resumed_trainer.model.state_dict()[name], tensor), name
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_layout_on_disk(tmp_path):
    run_training(Trainer(config(tmp_path, "train.exit_at_step=2", "checkpoint.every=1")))
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert [p.name for _, p in committed_checkpoints(root)] == ["step_00000002", "step_00000001"]
    manifest = json.loads((root / "step_00000002" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["layout"]["world_size"] == 1
    assert ".metadata" in manifest["files"] and "trainer_state.json" in manifest["files"]
    assert verify(root / "step_00000002") == []


def damage(path, how):
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    else:
        path.unlink()


@pytest.mark.parametrize(("target", "how", "message"), [
    ("__0_0.distcp", "flip", "sha256"),
    ("__0_0.distcp", "truncate", "bytes, expected"),
    (".metadata", "delete", ".metadata: missing"),
    ("manifest.json", "delete", "manifest.json: missing (the save never committed)"),
])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_passes_its_step(tmp_path, caplog, uninterrupted,
                                                                               target, how, message):
    """The damaged step_3 used to keep its name: the resumed run's save at step 3 then failed on every relaunch."""
    run_training(Trainer(config(tmp_path, "train.exit_at_step=3", "checkpoint.every=2")))  # saves steps 2 and 3
    root = tmp_path / "checkpoints"
    newest = root / "step_00000003"
    damage(newest / target, how)
    problems = verify(newest)
    assert problems and message in problems[0] and target in problems[0]
    passed = Trainer(config(tmp_path, "train.exit_at_step=3"))  # resumes step 2, then must save step 3 again
    assert losses_of(run_training(passed)) == uninterrupted[0][2:3]
    assert any("skipping" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    aside = [p for p in root.iterdir() if p.name.startswith("step_00000003.damaged-")]
    assert len(aside) == 1 and message in (aside[0] / "DAMAGED.txt").read_text()  # kept, with the reason
    assert verify(newest) == [] and (root / "latest").read_text().strip() == newest.name
    later = Trainer(config(tmp_path))  # a later relaunch resumes the new step 3
    assert losses_of(run_training(later)) == uninterrupted[0][3:] and later.step == STEPS


def test_latest_names_the_checkpoint_resumed_when_a_newer_one_is_damaged(tmp_path):
    run_training(Trainer(config(tmp_path, "train.exit_at_step=3", "checkpoint.every=2")))
    root = tmp_path / "checkpoints"
    damage(root / "step_00000003" / "__0_0.distcp", "truncate")
    trainer = Trainer(config(tmp_path, "train.exit_at_step=2"))  # resumes step 2: nothing left to train
    assert run_training(trainer) == [] and (root / "latest").read_text().strip() == "step_00000002"
    assert [step for step, _ in committed_checkpoints(root)] == [2]


def test_partial_save_directory_is_ignored(tmp_path, uninterrupted):
    run_training(Trainer(config(tmp_path, "train.exit_at_step=2")))
    (tmp_path / "checkpoints" / "step_00000004.tmp").mkdir()  # a save that died before committing
    resumed = losses_of(run_training(Trainer(config(tmp_path))))
    assert resumed == uninterrupted[0][2:]


def test_retention_keeps_last_and_multiples(tmp_path):
    run_training(Trainer(config(tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.keep_every=3")))
    kept = [step for step, _ in committed_checkpoints(tmp_path / "checkpoints")]
    assert kept == [6, 5, 3]


def test_resume_from_a_named_checkpoint_and_bad_paths(tmp_path):
    run_training(Trainer(config(tmp_path / "a", "train.exit_at_step=2")))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        run_training(Trainer(config(tmp_path / "b", f"train.resume={tmp_path / 'nowhere'}")))
    trainer = Trainer(config(tmp_path / "c", f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002'}"))
    assert len(run_training(trainer)) == STEPS - 2


def test_resume_with_another_optimizer_names_the_key(tmp_path):
    run_training(Trainer(config(tmp_path, "train.exit_at_step=1")))
    with pytest.raises(CheckpointError, match=r"optim\.name: checkpoint adamw, this run muon"):
        run_training(Trainer(config(tmp_path, "optim.name=muon")))


class NoisyTrainer(Trainer):
    """Draws from the global RNG every step, as dropout or router jitter would. The trainer reseeds at
    construction, so a resume that forgets the saved RNG state replays the first steps' noise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise: list[float] = []

    def train_step(self):
        self.noise.append(torch.rand(()).item())
        return super().train_step()


def test_rng_state_is_restored_on_the_same_world(tmp_path):
    straight = NoisyTrainer(config(tmp_path / "straight", "train.steps=4"))
    run_training(straight)
    first = NoisyTrainer(config(tmp_path / "split", "train.steps=4", "train.exit_at_step=2"))
    run_training(first)
    torch.manual_seed(12345)  # whatever happens in between
    resumed = NoisyTrainer(config(tmp_path / "split", "train.steps=4"))
    run_training(resumed)
    assert len(set(straight.noise)) == 4  # the draws differ step to step, so a replay would show
    assert first.noise + resumed.noise == straight.noise
