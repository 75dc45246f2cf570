"""Gated MLA against an explicit per-head softmax reference; packed-document masking; RoPE option."""

import math

import pytest
import torch
import torch.nn.functional as F

from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mla import GatedMLA, rotate
from moe_pretrain.planning.measured import LiveTensorBytes
from tests.helpers import rel_rms
from tests.models import F64, make_layer


def reference_mla(layer: GatedMLA, x: torch.Tensor, doc_ids: torch.Tensor, positions=None) -> torch.Tensor:
    """Loops over batch, heads and query positions; softmax written out."""
    cfg = layer.cfg
    B, T, _ = x.shape
    H, Dn, Dr, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def rms(v, w, eps):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    c_q = rms(x @ layer.q_down.weight.T, layer.q_norm.weight, cfg.lora_norm_eps)
    q = (c_q @ layer.q_up.weight.T).reshape(B, T, H, Dn + Dr)
    kv_low = x @ layer.kv_down.weight.T
    c_kv, k_rope = kv_low[..., : cfg.kv_lora_rank], kv_low[..., cfg.kv_lora_rank:]
    kv = (rms(c_kv, layer.kv_norm.weight, cfg.lora_norm_eps) @ layer.kv_up.weight.T).reshape(B, T, H, Dn + Dv)
    k_nope, v = kv[..., :Dn], kv[..., Dn:]
    if positions is not None:
        q = torch.cat([q[..., :Dn], rotate(q[..., Dn:], positions, cfg.rope_theta)], -1)
        k_rope = rotate(k_rope, positions, cfg.rope_theta)
    gate = torch.sigmoid(x @ layer.g_proj.weight.T).reshape(B, T, H, Dv)
    out = torch.zeros(B, T, H, Dv, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
                scores = torch.stack([
                    q[b, t, h] @ torch.cat([k_nope[b, s, h], k_rope[b, s]]) for s in keys
                ]) / math.sqrt(Dn + Dr)
                weights = torch.softmax(scores, 0)
                out[b, t, h] = sum(w * v[b, s, h] for w, s in zip(weights, keys)) * gate[b, t, h]
    return out.reshape(B, T, H * Dv) @ layer.o_proj.weight.T


@pytest.mark.parametrize("position", ["nope", "rope"])
def test_mla_matches_explicit_reference(position):
    layer, _ = make_layer(position)
    x = torch.randn(2, 9, 16, dtype=F64)
    doc_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    got = layer(x, layout)
    positions = layout.position_in_doc if position == "rope" else None
    want = reference_mla(layer, x, doc_ids, positions)
    assert rel_rms(got, want) < 1e-12


def test_packed_mask_blocks_attention_across_documents():
    layer, _ = make_layer()
    x = torch.randn(1, 10, 16, dtype=F64)
    layout = DocumentLayout.from_doc_ids(torch.tensor([[0] * 6 + [1] * 4]))
    base = layer(x, layout)
    x2 = x.clone()
    x2[:, :6] += torch.randn(1, 6, 16, dtype=F64)  # change document 0 only
    changed = layer(x2, layout)
    assert torch.equal(base[:, 6:], changed[:, 6:])
    assert not torch.allclose(base[:, :6], changed[:, :6])
    # The second document alone, as its own sequence, gives the same output.
    alone = layer(x[:, 6:], DocumentLayout.single_documents(1, 4, x.device))
    assert rel_rms(base[:, 6:], alone) < 1e-13


def test_output_gate_against_reference():
    """A strong, varied gate: W_g ~ N(0, 1) puts sigmoid(x W_g) all over (0, 1) channel by channel. The layer
    equals the reference, which multiplies each head's attention output by it before o_proj (1e-12, fp64),
    and differs from the same layer with the gate at a constant 1/2."""
    layer, _ = make_layer()
    x = torch.randn(2, 7, 16, dtype=F64)
    doc_ids = torch.tensor([[0] * 3 + [1] * 4, [0] * 7])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    with torch.no_grad():
        layer.g_proj.weight.normal_(0.0, 1.0)
        gate = torch.sigmoid(x @ layer.g_proj.weight.T)
        assert gate.min() < 0.05 and gate.max() > 0.95  # far from a constant
        got = layer(x, layout)
        assert rel_rms(got, reference_mla(layer, x, doc_ids)) < 1e-12
        layer.g_proj.weight.zero_()
        constant_half = layer(x, layout)
    assert rel_rms(got, constant_half) > 0.1


def dense_mask_attention(q, k, v, doc_ids, scale):
    """The former path: one [B, 1, T, T] mask, causal and within each document (the reference)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = ((doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & causal).unsqueeze(1)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, scale=scale).transpose(1, 2)


def test_document_attention_matches_the_dense_mask():
    """Several documents per row, one row a single document, float64: outputs and gradients equal the
    dense-mask path to 1e-12."""
    from moe_pretrain.ops.document_attention import document_causal_attention

    torch.manual_seed(0)
    B, T, H, D, Dv = 2, 37, 3, 6, 5
    doc_ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 11 + [3], [0] * 37])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    q, k = (torch.randn(B, T, H, D, dtype=F64, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, Dv, dtype=F64, requires_grad=True)
    expected = dense_mask_attention(q, k, v, doc_ids, 0.3)
    got = document_causal_attention(q.reshape(B * T, H, D), k.reshape(B * T, H, D), v.reshape(B * T, H, Dv),
                                    layout.document_bounds, 0.3).reshape(B, T, H, Dv)
    assert rel_rms(got, expected) < 1e-12
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        assert rel_rms(a, b) < 1e-12


def attention_live_peak(T: int) -> int:
    """Peak live tensor bytes of one T-token document's attention, forward + backward."""
    from moe_pretrain.ops.document_attention import document_causal_attention

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(T, 2, 48, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(T, 2, 32, generator=gen, requires_grad=True)  # narrower values, as MLA's (flash needs padding)
    with LiveTensorBytes() as live:
        document_causal_attention(q, k, v, [0, T], 0.1).sum().backward()
    return live.peak


def test_document_attention_memory_is_linear_in_t():
    """One 16K-token document, forward + backward: a [T, T] boolean mask alone would be 268 MB and fp32
    probabilities 1 GB per head; the flash path keeps q, k, v, output, the log-sum-exp and their gradients
    (measured 50 MB of live tensors, measured.LiveTensorBytes: every op's output, so a decomposed attention's
    T x T intermediates would count; a kernel's own tiles do not). Doubling T doubles it (measured 2.0x).
    Values narrower than queries (MLA's shape) must not push SDPA off its flash path."""
    peaks = [attention_live_peak(t) for t in (8192, 16384)]
    assert peaks[1] < 60e6, peaks
    assert peaks[1] <= 2.1 * peaks[0], peaks


def test_document_attention_backward_moves_bytes_linear_in_t_whatever_the_documents():
    """The backward gathers the documents' gradients in one concatenation per tensor: 1 document or 16 in the
    same T, the bytes the launches outside the attention kernels move are the same to 10% (a slice per
    document wrote a zero tensor of the whole sequence per document: 16 times as many)."""
    from moe_pretrain.ops.document_attention import document_causal_attention
    from moe_pretrain.planning.op_census import OpCensus

    T = 256
    moved = {}
    for documents in (1, 16):
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(T, 2, 48, generator=gen, requires_grad=True) for _ in range(2))
        v = torch.randn(T, 2, 32, generator=gen, requires_grad=True)
        bounds = list(range(0, T + 1, T // documents))
        with OpCensus() as ops:
            document_causal_attention(q, k, v, bounds, 0.1).sum().backward()
        moved[documents] = sum(size for name, size in ops.bytes_by_op.items()
                               if "scaled_dot_product" not in name)
    assert moved[16] <= 1.1 * moved[1], moved
