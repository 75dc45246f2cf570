"""Each collective autograd pair on real gloo ranks, against the single-process computation (the device check
and the rule that nothing else calls torch.distributed's collectives: tests/unit/test_collectives.py)."""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.local import run_distributed
from parallel.collectives import (
    CollectiveDeviceError,
    all_reduce_sum,
    all_to_all_rows,
    finish_rows,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    start_rows,
)
from parallel.vocab_parallel_loss import vocab_parallel_cross_entropy

F64 = torch.float64


def shared(*shape, seed=0):
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def collectives_worker(rank, world_size):
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    try:
        B, T, D = 2, 4 * world_size, 3
        full = shared(B, T, D)
        weight = shared(B, T, D, seed=1)  # a fixed upstream gradient
        chunk = T // world_size
        mine = slice(rank * chunk, (rank + 1) * chunk)

        # gather: forward all-gather; backward reduce-scatter of every rank's (partial) use.
        x = full[:, mine].clone().requires_grad_()
        gathered = gather_from_sequence_parallel(x, group)
        assert torch.equal(gathered, full)
        (gathered * weight * (rank + 1)).sum().backward()
        total = sum(r + 1 for r in range(world_size))
        assert torch.allclose(x.grad, (weight * total)[:, mine])

        # reduce-scatter: forward sum of partials, keep my shard; backward all-gather.
        partial = (full * (rank + 1)).requires_grad_()
        reduced = reduce_scatter_to_sequence_parallel(partial, group)
        assert torch.allclose(reduced, (full * total)[:, mine])
        (reduced * weight[:, mine]).sum().backward()
        assert torch.equal(partial.grad, weight)

        # scatter: forward keep my shard of a replicated tensor; backward all-gather.
        replicated = full.clone().requires_grad_()
        scattered = scatter_to_sequence_parallel(replicated, group)
        assert torch.equal(scattered, full[:, mine])
        (scattered * weight[:, mine]).sum().backward()
        assert torch.equal(replicated.grad, weight)

        # all-to-all rows: rank r sends r + 2s + 1 rows to rank s (a rank receives more or fewer rows than it
        # sends); backward returns gradients home.
        send = [rank + 2 * s + 1 for s in range(world_size)]
        receive = [s + 2 * rank + 1 for s in range(world_size)]
        rows = (torch.arange(sum(send), dtype=F64) + 100 * rank).unsqueeze(1).requires_grad_()
        got = all_to_all_rows(rows, receive, send, group)
        starts = [sum(s + 2 * q + 1 for q in range(rank)) for s in range(world_size)]
        expected = torch.cat([torch.arange(starts[s], starts[s] + receive[s], dtype=F64) + 100 * s
                              for s in range(world_size)])
        assert torch.equal(got.squeeze(1), expected)
        (got * got).sum().backward()
        assert torch.equal(rows.grad, 2 * rows.detach())

        # The same exchange twice in flight at once, each finished after the other's start, with work between:
        # the same rows, and gradients that come home through both.
        twice = rows.detach().clone().requires_grad_()
        first, first_exchange = start_rows(twice, receive, send, group)
        second, second_exchange = start_rows(twice * 3, receive, send, group)
        between = (twice * 2).sum()
        got_first, got_second = finish_rows(first, first_exchange), finish_rows(second, second_exchange)
        assert torch.equal(got_first, got) and torch.equal(got_second, 3 * got)
        ((got_first * got_first).sum() + got_second.sum() + between).backward()
        assert torch.equal(twice.grad, 2 * rows.detach() + 3 + 2)

        # vocab-parallel cross-entropy against F.cross_entropy on the whole vocabulary.
        V = 6 * world_size
        logits = shared(5, 7, V, seed=2) * 3
        target = torch.randint(0, V, (5, 7), generator=torch.Generator().manual_seed(3))
        local = logits[..., rank * 6:(rank + 1) * 6].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group)
        full_logits = logits.clone().requires_grad_()
        ref = F.cross_entropy(full_logits.reshape(-1, V), target.reshape(-1), reduction="none").reshape(5, 7)
        assert torch.allclose(loss, ref, rtol=1e-14, atol=1e-14)
        upstream = shared(5, 7, seed=4)
        (loss * upstream).sum().backward()
        (ref * upstream).sum().backward()
        assert torch.allclose(local.grad, full_logits.grad[..., rank * 6:(rank + 1) * 6], rtol=1e-13, atol=1e-15)

        # A real gloo group carries host tensors only: anything else is refused before any communication.
        with pytest.raises(CollectiveDeviceError, match=r"test_collectives\.py:\d+ \(collectives_worker\)"):
            all_reduce_sum(torch.empty(3, device="meta"), group)
        return True
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_pairs(world_size):
    assert run_distributed(collectives_worker, world_size)


"""torch.distributed's collective and point-to-point calls (the pipeline schedule's own p2p is torch's)."""


