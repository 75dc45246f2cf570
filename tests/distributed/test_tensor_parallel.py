"""Column-parallel layers sharing one InputGather (parallel/tensor_parallel.py) on two gloo processes: an input
three projections read crosses the wire once forward and once backward (counted by CollectiveTraffic), and
outputs and input gradients equal one process's: float64 to 1e-12; under bf16 autocast the wire carries bf16
(half the fp32 bytes) and the results stay within bf16's round-off of one process's (2e-2 rms)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launch.local import run_distributed
from moe_pretrain.planning.collective_traffic import CollectiveTraffic
from parallel.tensor_parallel import ColumnParallelLinear, InputGather
from tests.helpers import rel_rms

B, T, IN, OUT = 2, 6, 16, 8
READERS = 3


def reference(dtype: torch.dtype, autocast: bool):
    """One process: every projection whole, the outputs' squares summed as the loss."""
    torch.manual_seed(0)
    layers = [nn.Linear(IN, OUT, dtype=dtype) for _ in range(READERS)]
    x = torch.randn(B, T, IN, dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = [layer(x) for layer in layers]
    sum(o.float().pow(2).sum() for o in outs).backward()
    return layers, x, [o.detach() for o in outs]


def shared_gather_worker(rank: int, world: int, dtype: torch.dtype, autocast: bool):
    dist.init_process_group("gloo")
    try:
        return shared_gather(rank, world, dtype, autocast)
    finally:
        dist.destroy_process_group()


def shared_gather(rank: int, world: int, dtype: torch.dtype, autocast: bool):
    layers, x_full, ref_outs = reference(dtype, autocast)
    rows, seq = slice(rank * OUT // world, (rank + 1) * OUT // world), slice(rank * T // world, (rank + 1) * T // world)
    gather = InputGather(dist.group.WORLD)
    columns = []
    for layer in layers:
        local = nn.Linear(IN, OUT // world, dtype=dtype)
        local.weight, local.bias = nn.Parameter(layer.weight[rows].detach()), nn.Parameter(layer.bias[rows].detach())
        columns.append(ColumnParallelLinear(local, dist.group.WORLD, gather))
    x = x_full.detach()[:, seq].clone().requires_grad_()
    with CollectiveTraffic({"tp": dist.group.WORLD}) as traffic:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = [column(x) for column in columns]
        sum(o.float().pow(2).sum() for o in outs).backward()
    errors = [rel_rms(o, ref[..., rows]) for o, ref in zip(outs, ref_outs)] + [rel_rms(x.grad, x_full.grad[:, seq])]
    return dict(traffic.calls), dict(traffic.bytes), errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("dtype", "autocast", "tolerance", "wire_bytes"), [
    (torch.float64, False, 1e-12, 8), (torch.float32, True, 2e-2, 2)], ids=["float64", "bf16-autocast"])
def test_an_input_read_by_three_projections_is_gathered_once(dtype, autocast, tolerance, wire_bytes):
    calls, sizes, errors = run_distributed(shared_gather_worker, 2, dtype, autocast)
    assert calls == {("tp", "_allgather_base_"): 1, ("tp", "_reduce_scatter_base_"): 1}
    whole = B * T * IN * wire_bytes  # the gathered input forward, its gradient backward
    assert sizes == {("tp", "_allgather_base_"): whole, ("tp", "_reduce_scatter_base_"): whole}
    assert max(errors) < tolerance, errors
