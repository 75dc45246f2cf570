"""Training with the vision tower on images of several sizes in one batch: every layout equals one process
(float64, three steps, losses, gradient norms and every parameter (the tower's and projector's included)
within 1e-9 relative). Under tensor and context parallelism the ranks that share rows deal the images among
them and exchange the tokens (parallel/image_split.py); under pipeline parallelism the first stage encodes."""

import pytest

from launch.local import run_distributed
from moe_pretrain.data import PretrainingData
from moe_pretrain.training import Trainer
from tests.helpers import rel_rms
from tests.test_parallel_training import layout_config, train_worker

IMAGES = ["data.image_fraction=0.6", "data.text_doc_bytes=256"]


def test_the_batches_hold_images_of_several_sizes(tmp_path):
    data = PretrainingData(layout_config(tmp_path, "float64", *IMAGES))
    grids = [grid for _ in range(3) for grid in data.next_batch(8).image_grids]
    assert len({(h, w) for _, h, w in grids}) >= 3 and len(grids) >= 8, grids


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "overrides"), [
    (2, ["parallel.ep=2"]),  # dp2 (experts folded over the two data-parallel ranks)
    (4, ["parallel.tp=2", "parallel.ep=2"]),
    (2, ["parallel.pp=2", "data.micro_batches=2"]),
    (2, ["parallel.cp=2"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "model.mla.num_heads=4"]),
], ids=["dp2", "tp2xep2", "pp2", "cp2", "cp2xtp2"])
def test_vision_layout_matches_single_process_float64(tmp_path, world_size, overrides):
    reference = [o for o in overrides if not o.startswith("parallel.")]
    trainer = Trainer(layout_config(tmp_path / "single", "float64", *IMAGES, *reference))
    ref_losses = [(h["loss"], h["grad_norm"]) for h in trainer.run()]
    ref_state = trainer.model.state_dict()
    losses, state, identical, _, _ = run_distributed(
        train_worker, world_size, str(tmp_path / "parallel"), "float64", [*IMAGES, *overrides])
    assert [x for pair in losses for x in pair] == pytest.approx([x for pair in ref_losses for x in pair], rel=1e-9)
    vision = [name for name in ref_state if name.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 12  # one block of 6 weights, patch and position embeddings, final norm; projector 3
    for name, tensor in ref_state.items():
        assert rel_rms(state[name], tensor) < 1e-9, name
    assert identical
