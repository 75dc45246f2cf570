"""parallel/optimizer.ShardedOptimizer overlaps its collectives with compute (2 processes, gloo): each bucket's
gradient reduce-scatter starts during the step's last backward (every bucket before reduce_gradients, in
the fixed order on both ranks; bitwise the sums of reducing after the backward), and the parameters'
all-gathers run into the next forward, each layer waiting for its own (bitwise the same forward)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launch.local import run_distributed
from parallel.optimizer import ParamGroupSpec, ShardedOptimizer

MICRO_BATCHES = 3


def model_and_optimizer() -> tuple[nn.Module, ShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(5)))
    params = list(model.parameters())
    # Buckets of about one layer (16 x 16 + 16 floats): five buckets, started in reverse model order.
    optimizer = ShardedOptimizer([ParamGroupSpec(params, dist.group.WORLD, 0.0)], lr=1e-3, betas=(0.9, 0.95),
                             eps=1e-8, bucket_bytes=(16 * 16 + 16) * 4, norm_group=dist.group.WORLD)
    return model, optimizer


def forward(model: nn.Module, x: torch.Tensor, skip_third: bool) -> torch.Tensor:
    for i, layer in enumerate(model):
        x = x if (skip_third and i == 2) else torch.tanh(layer(x))
    return x


def overlap_worker(rank: int, world_size: int, skip_third: bool) -> tuple:
    dist.init_process_group("gloo")
    try:
        grads, started = [], None
        for backwards in (MICRO_BATCHES, None):  # overlapped, then all reduced after the backward
            model, optimizer = model_and_optimizer()
            optimizer.zero_grad(backwards=backwards)
            gen = torch.Generator().manual_seed(10 + rank)
            for _ in range(MICRO_BATCHES):
                forward(model, torch.randn(8, 16, generator=gen), skip_third).square().sum().backward()
            if backwards is not None:
                started = [bucket.started for bucket in optimizer.start_order]
            optimizer.reduce_gradients()
            grads.append(torch.cat([b.shard.grad for b in optimizer.buckets]))
        model, optimizer = model_and_optimizer()
        optimizer.zero_grad(backwards=1)
        x = torch.randn(8, 16)
        forward(model, x, False).sum().backward()
        try:
            forward(model, x, False).sum().backward()  # one more backward than the step was armed for
            refused = False
        except RuntimeError as error:
            refused = "reduce-scatter had started" in str(error)
        optimizer.reduce_gradients()
        return started, torch.equal(grads[0], grads[1]), refused
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_reduce_scatters_start_during_the_last_backward():
    started, same, refused = run_distributed(overlap_worker, 2, False)
    assert started == [True] * 5 and same and refused


@pytest.mark.timeout(120)
def test_a_bucket_without_a_gradient_holds_back_only_the_buckets_after_it():
    """Layer 2 is skipped: its bucket never completes, so it and the buckets after it in the start order
    (layers 1 and 0) start in reduce_gradients; the sums are the same."""
    started, same, _ = run_distributed(overlap_worker, 2, True)
    assert started == [True, True, False, False, False] and same


def gather_worker(rank: int, world_size: int) -> tuple:
    dist.init_process_group("gloo")
    try:
        outputs, pending_after_update = [], None
        for gated in (True, False):
            model, optimizer = model_and_optimizer()
            if gated:
                optimizer.gate_parameter_use(model, list(model))
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
            optimizer.zero_grad(backwards=1)
            forward(model, x, False).square().sum().backward()
            optimizer.update(1.0, float(optimizer.reduce_gradients()))
            if gated:  # still under way: the forward's layers wait for them one by one
                pending_after_update = [bucket.gathering is not None for bucket in optimizer.buckets]
            outputs.append(forward(model, x, False).detach())
            if gated:
                assert all(bucket.gathering is None for bucket in optimizer.buckets)
        model, optimizer = model_and_optimizer()
        optimizer.gate_parameter_use(model, list(model))
        optimizer.zero_grad(backwards=1)
        forward(model, torch.randn(8, 16), False).sum().backward()
        optimizer.update(1.0, float(optimizer.reduce_gradients()))
        model.state_dict()  # what saves and exports read: it waits for every gather
        finished_by_state_dict = all(bucket.gathering is None for bucket in optimizer.buckets)
        return pending_after_update, torch.equal(*outputs), finished_by_state_dict
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_parameter_gathers_run_into_the_next_forward():
    pending, same, finished_by_state_dict = run_distributed(gather_worker, 2)
    assert pending == [True] * 5 and same and finished_by_state_dict
