"""FP8 delayed scaling over data-parallel ranks: the amax histories agree on every rank and are checkpointed (the
GEMMs' numerics: tests/unit/test_fp8_gemms.py; a training run against bf16: tests/integration/test_fp8_training.py)."""


import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.checkpoint import committed_checkpoints
from moe_pretrain.fp8.experts import FP8_HISTORY
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from moe_pretrain.training.state import TrainingState
from parallel.collectives import all_gather_stacked
from parallel.state import ParallelContext, destroy_parallel, init_parallel
from tests.models import tiny_config

"""Every FP8 error is above this (bf16 GEMMs measure 0.003): proof the GEMMs were quantized at all."""


def delayed_worker(rank, world_size, run_dir, overrides):
    """2 ranks, 3 steps of delayed FP8 and a checkpoint: every rank's histories (gathered to rank 0)."""
    cfg = tiny_config("train.steps=3", "train.dtype=float32", "precision.fp8=delayed", "logging.progress=false",
                      f"train.run_dir={run_dir}", *overrides)
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        run_training(trainer)
        histories = {k: v for k, v in trainer.model.state_dict().items() if k.endswith(FP8_HISTORY)}
        return {k: all_gather_stacked(v.contiguous(), dist.group.WORLD) for k, v in histories.items()}
    finally:
        destroy_parallel()


@pytest.mark.timeout(240)
def test_delayed_histories_agree_over_data_parallel_ranks_and_are_checkpointed(tmp_path):
    """dp2: both ranks hold every expert and end with equal histories; ep2: each holds its experts' histories,
    sharded like the weights; either way one process resumes exactly what was saved."""
    sharded = run_distributed(delayed_worker, 2, str(tmp_path / "ep2"), ["parallel.ep=2"])
    (_, ep_checkpoint), *_ = committed_checkpoints(tmp_path / "ep2" / "checkpoints")
    gathered = run_distributed(delayed_worker, 2, str(tmp_path), [])
    assert gathered  # one history per MoE layer
    for key, per_rank in gathered.items():
        assert torch.equal(per_rank[0], per_rank[1]), key  # one all-reduced amax per step on both ranks
        assert (per_rank[0][:, -3:] > 0).all() and (per_rank[0][:, :-3] == 0).all(), key  # 3 steps recorded
        assert sharded[key].shape[1] == per_rank.shape[1] // 2, key  # ep2: half the experts on each rank
    (_, checkpoint), *_ = committed_checkpoints(tmp_path / "checkpoints")
    cfg = tiny_config("precision.fp8=delayed", "train.dtype=float32")
    state = TrainingState(cfg, ParallelContext.single(), draw_values=False)
    state.load(checkpoint)
    for key, per_rank in gathered.items():
        assert torch.equal(state.model.state_dict()[key], per_rank[0]), key  # resumed as saved
    state.load(ep_checkpoint)
    for key, per_rank in sharded.items():
        assert torch.equal(state.model.state_dict()[key], torch.cat(list(per_rank))), key  # both ranks' experts
    off = TrainingState(tiny_config("train.dtype=float32"), ParallelContext.single(), draw_values=False)
    off.load(checkpoint)  # a run without FP8 ignores the histories
    fresh = TrainingState(cfg, ParallelContext.single(), draw_values=False)
    off.save(tmp_path / "off")
    fresh.load(committed_checkpoints(tmp_path / "off")[0][1])  # ...and one written without them loads with empty ones
    assert all((fresh.model.state_dict()[key] == 0).all() for key in gathered)


