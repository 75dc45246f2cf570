"""The matmuls' weights held in bf16 with fp32 masters in the optimizer (train.param_dtype=bfloat16), on several
processes against the same layout held in fp32, and across a checkpoint either way.

Under bf16 autocast an fp32 weight reaches every matmul as its bf16 cast, and its gradient is the bf16 product
cast to fp32. Held in bf16 with an fp32 master of each rank's slice and an fp32 gradient buffer, the forward
reads the same bf16 values and the buffer receives the same sums, and the optimizer steps the same fp32 values:
the losses are bitwise the same and every weight is the fp32 run's, rounded to bf16 where it is held so. Only
the gradient norm may differ in its last bits (its buckets hold other parameters), so clipping is off here.
A checkpoint stores the fp32 masters under the parameters' keys: a run resumed under the other setting continues
as if it had never stopped.
"""

import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.collectives import gather_objects
from parallel.optimizer import ParamGroupSpec, ShardedOptimizer
from parallel.parallelize import gather_full_state
from parallel.state import destroy_parallel, init_parallel
from tests.models import tiny_config

EXACT = ["train.dtype=bfloat16", "optim.grad_clip=0", "optim.name=muon", "data.batch_size=8",
         "data.micro_batches=2", "logging.progress=false"]
"""bf16 autocast, two micro-batches (the gradient buffer accumulates), Muon for the matrices, no clipping."""
HELD = ["train.param_dtype=bfloat16"]


def train(rank, world_size, run_dir, overrides):
    """(per-step losses, the whole model gathered, this rank's masters) after the run."""
    cfg = tiny_config(*EXACT, f"train.run_dir={run_dir}", *overrides)
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        losses = [h["loss"] for h in run_training(trainer)]
        masters = [b.master.clone() for b in trainer.optimizer.buckets if b.master is not None]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, masters)
        return losses, gather_full_state(trainer.model, ctx), everyone
    finally:
        destroy_parallel()


def assert_held_is_rounded(held: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Every weight held in bf16 is the fp32 run's rounded; every other the fp32 run's, bitwise."""
    lowered = [name for name, tensor in held.items() if tensor.dtype == torch.bfloat16]
    assert any("experts" in name for name in lowered) and any("q_up" in name for name in lowered), lowered
    assert not any("router.gate" in name or "norm" in name for name in lowered), lowered
    for name, tensor in held.items():
        assert torch.equal(tensor, full[name].to(tensor.dtype)), name


@pytest.mark.timeout(300)
def test_bf16_held_weights_train_bitwise_as_fp32_ones_on_pp2(tmp_path):
    """Expert parallelism's case follows from the checkpoint test below (an fp32-held run's two steps resumed
    under bf16 continue bitwise as a bf16-held run from the start)."""
    layout = ["train.steps=3", "parallel.pp=2"]
    full_losses, full, _ = run_distributed(train, 2, str(tmp_path / "fp32"), layout)
    held_losses, held, masters = run_distributed(train, 2, str(tmp_path / "bf16"), [*layout, *HELD])
    assert held_losses == full_losses
    assert_held_is_rounded(held, full)
    assert all(m for m in masters)  # every rank keeps masters of its slices


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_under_either_parameter_dtype(tmp_path):
    """ep2 x dp2 on 2 processes: 3 steps straight with bf16-held weights; the same stopped after step 2 and
    resumed, once with the same setting (the masters bitwise), once from an fp32-held run's checkpoint."""
    layout = ["train.steps=3", "parallel.ep=2"]
    straight_losses, straight, straight_masters = run_distributed(train, 2, str(tmp_path / "straight"),
                                                                  [*layout, *HELD])
    for first in (HELD, []):
        run_dir = str(tmp_path / f"stopped-{bool(first)}")
        stopped_losses = run_distributed(train, 2, run_dir, [*layout, *first, "train.exit_at_step=2"])[0]
        resumed_losses, resumed, resumed_masters = run_distributed(train, 2, run_dir, [*layout, *HELD])
        assert stopped_losses + resumed_losses == straight_losses, first
        assert all(torch.equal(resumed[name], tensor) for name, tensor in straight.items()), first
        assert all(torch.equal(a, b) for rank_a, rank_b in zip(resumed_masters, straight_masters)
                   for a, b in zip(rank_a, rank_b, strict=True)), first


def scaled_slices(rank, world_size):
    """Every rank's (master slice, its start) of a [5, 6] weight held in bf16 after scale_rows, with the weight's
    rows scaled in fp32 and the held weight."""
    init_parallel(tiny_config())
    try:
        weight = torch.nn.Parameter(torch.randn(5, 6, generator=torch.Generator().manual_seed(0)))
        expected = weight.detach() * torch.arange(1.0, 6.0)[:, None]
        optimizer = ShardedOptimizer([ParamGroupSpec([weight], dist.group.WORLD, 0.0)], lr=1e-3, betas=(0.9, 0.95),
                                     eps=1e-8, bucket_bytes=2**20, norm_group=dist.group.WORLD,
                                     held_in={id(weight): torch.bfloat16})
        optimizer.scale_rows(weight, torch.arange(1.0, 6.0))
        bucket = optimizer.buckets[0]
        return gather_objects((bucket.master.clone(), bucket.start), dist.group.WORLD), expected, weight.detach()
    finally:
        destroy_parallel()


@pytest.mark.timeout(120)
def test_scaling_rows_reaches_a_slice_that_starts_and_ends_inside_rows():
    """QK-clip's edit of a bf16-held weight: on 2 ranks each holds 15 of its 30 elements (row 2 cut after its
    third element); each slice of the master is the fp32 weight's rows scaled, and the held weight the
    rounding of its bf16 values scaled."""
    slices, expected, held = run_distributed(scaled_slices, 2)
    assert [start for _, start in slices] == [0, 15]
    for master, start in slices:
        assert torch.equal(master, expected.flatten()[start:start + 15])
    assert held.dtype == torch.bfloat16 and torch.allclose(held.float(), expected, rtol=2**-7, atol=0)
