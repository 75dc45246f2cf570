"""FlexAttention (gpu_kernels/flex_attention.py) on CUDA, forward and backward, against the per-document SDPA
reference: float32 within 1e-4 (outputs and gradients, relative rms), and bf16 (what training runs) within 2e-2 of
the float32 reference, MLA's head dims (192 / 128)."""

import pytest
import torch

from gpu_kernels.flex_attention import document_block_mask, flex_document_attention
from moe_pretrain.ops.document_attention import document_causal_attention
from tests.helpers import rel_rms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_forward_and_backward_match_the_reference_on_cuda(dtype):
    bounds = [0, 1, 700, 1024, 1500, 4096]
    N, H = bounds[-1], 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(N, H, d, device="cuda", generator=gen).to(dtype) for d in (192, 192, 128)]
    results = []
    for attend, in_dtype in ((lambda q, k, v: flex_document_attention(q, k, v, document_block_mask(
                                 torch.tensor(bounds, device="cuda"), N), 0.07), dtype),
                             (lambda q, k, v: document_causal_attention(q, k, v, bounds, 0.07), torch.float32)):
        leaves = [t.to(in_dtype, copy=True).requires_grad_() for t in inputs]  # fresh leaves per run
        out = attend(*leaves)
        out.backward(torch.ones_like(out))
        results.append([out.detach().float(), *(t.grad.float() for t in leaves)])
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    for got, want in zip(*results, strict=True):
        assert rel_rms(got, want) < bound
