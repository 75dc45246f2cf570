"""ops.latent_causal_attention against expanding every key and ops.document_causal_attention: forward and every
gradient for a context-parallel rank's queries (float64), and under bf16 autocast."""

import pytest
import torch

from moe_pretrain.ops.document_attention import document_causal_attention
from moe_pretrain.ops.latent_attention import latent_causal_attention

H, D, DV, R, C = 2, 6, 4, 3, 5  # heads, query-key dims, value dims, rope dims (shared by the heads), latent


def expander(w_k, w_v, norm):
    """MLA's shape: keys [nope from the normed latent | rope part shared by every head], values from it."""
    def expand(latent, start, end):
        c, rope = latent[:, :C - R], latent[:, C - R:]
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        k = torch.cat([(c @ w_k).unflatten(-1, (H, D - R)), rope[:, None].expand(-1, H, R)], dim=-1)
        return k, (c @ w_v).unflatten(-1, (H, DV))
    return expand


@pytest.mark.parametrize(("cp", "rank", "query_block", "key_block"), [(1, 0, 1024, 1024), (2, 1, 3, 5), (4, 0, 2, 7),
                                                                       (4, 3, 4, 3), (8, 5, 1, 2)])
def test_latent_attention_matches_the_expanded_reference(cp, rank, query_block, key_block):
    torch.manual_seed(cp * 10 + rank)
    bounds = [0, 1, 9, 10, 23, 24, 25, 40, 48, 64]  # two rows of 32 (documents never cross 32): one-token docs
    M = bounds[-1]
    q = torch.randn(M, H, D, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(M, C, dtype=torch.float64, requires_grad=True)
    w_k = torch.randn(C - R, H * (D - R), dtype=torch.float64, requires_grad=True)
    w_v = torch.randn(C - R, H * DV, dtype=torch.float64, requires_grad=True)
    norm = torch.rand(C - R, dtype=torch.float64, requires_grad=True)
    expand = expander(w_k, w_v, norm)
    T, F = 32, 32 // (2 * cp)  # each row's load-balanced fragments: r and 2 cp - 1 - r
    mine = [row * T + j * F + t for row in (0, 1) for j in (rank, 2 * cp - 1 - rank) for t in range(F)]
    grad_out = torch.randn(len(mine), H, DV, dtype=torch.float64)
    k, v = expand(latent, 0, M)
    reference = document_causal_attention(q, k, v, bounds, scale=0.4)[mine]
    out = latent_causal_attention(q[mine], mine, latent, bounds, expand, (w_k, w_v, norm), 0.4,
                                  query_block=query_block, key_block=key_block)
    torch.testing.assert_close(out, reference, rtol=1e-9, atol=1e-12)
    inputs = (q, latent, w_k, w_v, norm)
    want = torch.autograd.grad(reference, inputs, grad_out)
    got = torch.autograd.grad(out, inputs, grad_out)
    for name, a, b in zip(("q", "latent", "w_k", "w_v", "norm"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


def test_latent_attention_under_bf16_autocast_is_close_to_float64():
    """The precision users train in: expansion under autocast (bf16 keys and values), scores and the online
    softmax in fp32; the backward expands in the forward's precision. Measured gaps to float64 0.2-1.1%
    (rms, relative); the bound 2% stays far below a broken merge or a mismatched backward (O(1))."""
    torch.manual_seed(0)
    bounds, M = [0, 1, 9, 10, 23, 24, 25, 40, 48, 64], 64
    leaves = [torch.randn(M, H, D), torch.randn(M, C), torch.randn(C - R, H * (D - R)) / 2,
              torch.randn(C - R, H * DV) / 2, torch.rand(C - R)]
    grad_out = torch.randn(M, H, DV)

    def run(dtype, autocast):
        q, latent, w_k, w_v, norm = (t.to(dtype).requires_grad_() for t in leaves)

        def expand(block, start, end):  # F.linear, which autocast casts to bf16
            c, rope = block[:, :C - R], block[:, C - R:]
            c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
            k = torch.cat([torch.nn.functional.linear(c, w_k.T).unflatten(-1, (H, D - R)),
                           rope[:, None].expand(-1, H, R).to(c.dtype)], dim=-1)
            return k, torch.nn.functional.linear(c, w_v.T).unflatten(-1, (H, DV))

        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = latent_causal_attention(q, list(range(M)), latent, bounds, expand, (w_k, w_v, norm), 0.4,
                                          query_block=8, key_block=16)
        grads = torch.autograd.grad(out, (q, latent, w_k, w_v, norm), grad_out.to(out.dtype))
        return [out.detach().double(), *(g.double() for g in grads)]

    def rel_rms(a, b):
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    gaps = [rel_rms(a, b) for a, b in zip(run(torch.float32, True), run(torch.float64, False), strict=True)]
    assert max(gaps) < 0.02, gaps
