"""Checkpoints across layouts: saved on one, resumed on another (resharding on load), Muon's momentum included
(in one process: tests/integration/test_checkpoint_resume.py)."""


import pytest
import torch

from launch.local import run_distributed
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.parallelize import gather_full_state
from parallel.state import destroy_parallel, init_parallel
from tests.checkpoint_cases import config, losses_of, uninterrupted_run
from tests.helpers import rel_rms


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_run(tmp_path_factory.mktemp("full"))


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


@pytest.mark.timeout(300)
def test_save_on_one_process_resume_on_pp2(tmp_path, uninterrupted):
    first = losses_of(run_training(Trainer(config(tmp_path, "data.micro_batches=2", "train.exit_at_step=3"))))
    resumed, state = run_distributed(layout_worker, 2, str(tmp_path), ["parallel.pp=2", "data.micro_batches=2"])
    reference = Trainer(config(tmp_path / "ref", "data.micro_batches=2", "train.resume=none"))
    expected = losses_of(run_training(reference))
    assert first + resumed == pytest.approx(expected, rel=1e-9)
    for name, tensor in reference.model.state_dict().items():
        assert rel_rms(state[name], tensor) < 1e-9, name
