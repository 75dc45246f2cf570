"""FlexAttention (gpu_kernels/flex_attention.py) on CUDA, forward and backward, against the per-document SDPA
reference: float32 within 1e-4 (outputs and gradients, relative rms), MLA's head dims (192 / 128)."""

import torch

from gpu_kernels.flex_attention import document_block_mask, flex_document_attention
from moe_pretrain.ops.document_attention import document_causal_attention
from tests.helpers import rel_rms


def test_flex_attention_forward_and_backward_match_the_reference_on_cuda():
    bounds = [0, 1, 700, 1024, 1500, 4096]
    N, H = bounds[-1], 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(N, H, d, device="cuda", generator=gen) for d in (192, 192, 128)]
    results = []
    for attend in (lambda q, k, v: flex_document_attention(q, k, v, document_block_mask(
                       torch.tensor(bounds, device="cuda"), N), 0.07),
                   lambda q, k, v: document_causal_attention(q, k, v, bounds, 0.07)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attend(*leaves)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*results, strict=True):
        assert rel_rms(got, want) < 1e-4
