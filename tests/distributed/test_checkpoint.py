"""Checkpoints: exact resume, verification and fallback, atomic commits, retention, resharding on load."""

import json

import pytest
import torch

from launch.local import run_distributed
from moe_pretrain.checkpoint import CheckpointError, committed_checkpoints, verify
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.parallelize import gather_full_state
from parallel.state import destroy_parallel, init_parallel
from tests.helpers import rel_rms
from tests.models import tiny_config

STEPS = 6


def config(run_dir, *overrides):
    return tiny_config(f"train.steps={STEPS}", "train.dtype=float64", "data.batch_size=8", "logging.progress=false",
                       f"train.run_dir={run_dir}", *overrides)


def losses_of(history):
    return [h["loss"] for h in history]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = Trainer(config(tmp_path_factory.mktemp("full") / "run", "train.resume=none"))
    return losses_of(run_training(trainer)), trainer.model.state_dict()


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


def layout_worker(rank, world_size, run_dir, overrides):
    cfg = config(run_dir, *overrides)
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        history = run_training(trainer)
        return losses_of(history), gather_full_state(trainer.model, ctx)
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_save_on_tp2_ep2_resume_on_one_process(tmp_path, uninterrupted):
    first, _ = run_distributed(layout_worker, 2, str(tmp_path), ["parallel.tp=2", "parallel.ep=2",
                                                                   "train.exit_at_step=3"])
    trainer = Trainer(config(tmp_path))
    resumed = losses_of(run_training(trainer))
    assert first + resumed == pytest.approx(uninterrupted[0], rel=1e-9)
    for name, tensor in uninterrupted[1].items():
        assert rel_rms(trainer.model.state_dict()[name], tensor) < 1e-9, name


@pytest.mark.timeout(400)
def test_save_on_tp2_ep2_four_processes_resume_on_pp2_dp2(tmp_path):
    mb = "data.micro_batches=2"
    first, _ = run_distributed(layout_worker, 4, str(tmp_path), ["parallel.tp=2", "parallel.ep=2", mb,
                                                                   "train.exit_at_step=3"])
    resumed, state = run_distributed(layout_worker, 4, str(tmp_path), ["parallel.pp=2", mb])
    reference = Trainer(config(tmp_path / "ref", mb, "train.resume=none"))
    expected = losses_of(run_training(reference))
    assert first + resumed == pytest.approx(expected, rel=1e-9)
    for name, tensor in reference.model.state_dict().items():
        assert rel_rms(state[name], tensor) < 1e-9, name


@pytest.mark.timeout(300)
def test_muon_momentum_resumes_bitwise_and_reshards(tmp_path):
    """Muon's momentum is saved per parameter like Adam's moments: a resume on the same layout is bitwise, and a
    run saved on 4 processes (dense momentum in 4 slices, experts over ep=2, tensor-parallel o_proj joined)
    resumes on one process equal to one process throughout (1e-9); with a multi-token-prediction block, whose
    tensor- and expert-parallel shards reshard as the backbone's."""
    muon = "optim.name=muon model.mtp.layers=1"
    straight = Trainer(config(tmp_path / "straight", *muon.split()))
    expected = losses_of(run_training(straight))
    first = losses_of(run_training(Trainer(config(tmp_path / "same", *muon.split(), "train.exit_at_step=3"))))
    resumed = Trainer(config(tmp_path / "same", *muon.split()))
    assert first + losses_of(run_training(resumed)) == expected
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    saved, _ = run_distributed(layout_worker, 4, str(tmp_path / "moved"), [
        *muon.split(), "parallel.tp=2", "parallel.ep=2", "train.exit_at_step=3"])
    moved = Trainer(config(tmp_path / "moved", *muon.split()))
    assert saved + losses_of(run_training(moved)) == pytest.approx(expected, rel=1e-9)
    for name, tensor in straight.model.state_dict().items():
        assert rel_rms(moved.model.state_dict()[name], tensor) < 1e-9, name


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


@pytest.mark.timeout(300)
def test_save_on_one_process_resume_on_pp2(tmp_path, uninterrupted):
    first = losses_of(run_training(Trainer(config(tmp_path, "data.micro_batches=2", "train.exit_at_step=3"))))
    resumed, state = run_distributed(layout_worker, 2, str(tmp_path), ["parallel.pp=2", "data.micro_batches=2"])
    reference = Trainer(config(tmp_path / "ref", "data.micro_batches=2", "train.resume=none"))
    expected = losses_of(run_training(reference))
    assert first + resumed == pytest.approx(expected, rel=1e-9)
    for name, tensor in reference.model.state_dict().items():
        assert rel_rms(state[name], tensor) < 1e-9, name
