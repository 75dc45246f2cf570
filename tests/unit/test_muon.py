"""parallel/muon.py and the sharded optimizer's Muon groups on one process: the step is Muon's formula on the
parameters themselves, and owners balance the Newton-Schulz work. (Layouts against one process:
tests/distributed/test_parallel_training.py; momentum in checkpoints: tests/distributed/test_checkpoint.py.)"""

import torch
from torch import nn

from moe_pretrain.ops.newton_schulz import muon_update
from parallel.muon import MatrixSpec, assign_owners, bucket_matrices, newton_schulz_cost
from parallel.optimizer import ParamGroupSpec, ShardedOptimizer


def test_one_process_step_is_muon_on_the_parameters():
    """Two steps of per-head Muon on a [3 heads x 4, 6] projection and a batch of 2 experts [2, 5, 3], against
    the formula in float64: m <- 0.95 m + g; w <- w (1 - lr wd) - lr muon_update(g + 0.95 m) (1e-12)."""
    torch.manual_seed(0)
    q = nn.Parameter(torch.randn(12, 6, dtype=torch.float64))
    experts = nn.Parameter(torch.randn(2, 5, 3, dtype=torch.float64))
    specs = [MatrixSpec((1, 12, 6), block_rows=4), MatrixSpec((2, 5, 3))]
    want = {"q": q.detach().clone(), "experts": experts.detach().clone()}
    momentum = {name: torch.zeros_like(w) for name, w in want.items()}
    heads = {"q": 3, "experts": 1}
    optimizer = ShardedOptimizer([ParamGroupSpec([q, experts], None, 0.1, matrices=specs)], lr=0.02,
                                 betas=(0.9, 0.95), eps=1e-8, bucket_bytes=2**20, norm_group=None)
    for _ in range(2):
        grads = {"q": torch.randn_like(q), "experts": torch.randn_like(experts)}
        optimizer.zero_grad()
        q.grad.copy_(grads["q"])
        experts.grad.copy_(grads["experts"])
        optimizer.reduce_gradients()
        optimizer.update(max_norm=0.0, total_norm=1.0)
        for name, g in grads.items():
            momentum[name] = 0.95 * momentum[name] + g
            want[name] = want[name] * (1 - 0.02 * 0.1) - 0.02 * muon_update(g + 0.95 * momentum[name], heads[name])
    assert torch.allclose(q.detach(), want["q"], rtol=0, atol=1e-12)
    assert torch.allclose(experts.detach(), want["experts"], rtol=0, atol=1e-12)
    assert optimizer.state_bytes() == (q.numel() + experts.numel()) * 8  # one momentum, no Adam moments


def test_owners_balance_newton_schulz_cost():
    """Per-head blocks, experts and whole matrices are each one unit; longest first to the least loaded rank
    leaves every rank within one unit's cost of the mean, and the loads carry to the next bucket."""
    specs = [MatrixSpec((1, 64, 32), block_rows=16), MatrixSpec((8, 48, 16)), MatrixSpec((1, 32, 128)),
             MatrixSpec((1, 16, 64), tensor_dim=-2)]
    offsets = [0, 64 * 32, 64 * 32 + 8 * 48 * 16, 64 * 32 + 8 * 48 * 16 + 32 * 128]
    matrices = bucket_matrices(specs, offsets)
    assert len(matrices) == 4 + 8 + 1 + 1
    assert [m.start for m in matrices[:5]] == [0, 512, 1024, 1536, 2048]
    loads = [0, 0, 0]
    owners = assign_owners(matrices, loads, tp=2)
    costs = [newton_schulz_cost(*m.whole_shape(2)) for m in matrices]
    assert matrices[-1].whole_shape(2) == (32, 64)  # the tensor-parallel slice is priced whole
    assert [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)] == loads
    assert max(loads) - min(loads) <= max(costs)
    before = list(loads)
    assert assign_owners(matrices[:1], loads, tp=2) == [before.index(min(before))]
