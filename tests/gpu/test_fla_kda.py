"""fla's chunk_kda on the GPU (through our custom ops, gpu_kernels/kda/fla_ops.py) against our PyTorch chunk form
on the CPU, fp32 (docs/model.md's KDA).

Packed documents (cu_seqlens), initial and final states, the bounded gate through fla's safe-gate path.
Tolerance: 2e-3 relative RMS on the output, final state and every gradient (fla computes in fp32 with
TF32-free Triton dots on its own chunk tiling; the reference is fp32 on another summation order).
"""

import pytest
import torch

from moe_pretrain.ops.kda import kda
from tests.helpers import rel_rms

pytest.importorskip("fla")
BOUND = 2e-3


def inputs(total: int, heads: int, dim: int, lower_bound: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, total, heads, dim, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, total, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, total, heads, dim, generator=gen)
    g = lower_bound * torch.sigmoid(torch.randn(1, total, heads, dim, generator=gen) * 2 - 2)
    beta = torch.sigmoid(torch.randn(1, total, heads, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fla_chunk_kda_matches_the_cpu_reference(lower_bound):
    cu_seqlens = torch.tensor([0, 100, 300, 333, 512])
    q, k, v, g, beta = inputs(512, 4, 64, lower_bound or -5.0)
    state = torch.randn(4, 4, 64, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v, g, beta, state)]
        o, final = kda(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu_seqlens.to(device),
                       output_final_state=True, lower_bound=lower_bound, fla=device == "cuda")
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(device)
        ((o * weights).sum() + final.sum()).backward()
        results.append([o, final, *(leaf.grad for leaf in leaves)])
    names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    for name, ref, got in zip(names, *results):
        err = rel_rms(got.cpu().double(), ref.double())
        assert err < BOUND, f"{name}: relative RMS {err:.2e} (bound {BOUND})"
