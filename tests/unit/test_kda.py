"""ops.kda (chunked WY/UT form) against the token-by-token recurrence, in float64."""

import pytest
import torch

from moe_pretrain.ops import kda, kda_recurrent
from moe_pretrain.planning.measured import LiveTensorBytes
from tests.helpers import rel_rms

F64 = torch.float64


def make_inputs(B, T, H, K, V, gate="lower_bound", dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    logits = torch.randn(B, T, H, K, generator=gen, dtype=dtype) * 2
    if gate == "lower_bound":
        g = -5.0 * torch.sigmoid(logits)
    else:
        g = -torch.nn.functional.softplus(logits) * 3  # unbounded: stresses the overflow-free form
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 150])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_chunked_matches_recurrence(T, gate):
    q, k, v, g, beta = make_inputs(2, T, 3, 16, 8, gate)
    h0 = torch.randn(2, 3, 16, 8, dtype=F64)
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    # Tolerance: both are exact float64 algorithms; 1e-10 relative RMS leaves room for round-off only.
    assert rel_rms(o, o_ref) < 1e-10
    assert rel_rms(s, s_ref) < 1e-10


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_documents_reset_state(chunk_size):
    lengths = [40, 1, 109, 70]
    T = sum(lengths)
    q, k, v, g, beta = make_inputs(1, T, 2, 8, 8, seed=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s = kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    assert s.shape == (4, 2, 8, 8)
    assert rel_rms(o, o_ref) < 1e-10 and rel_rms(s, s_ref) < 1e-10
    # Each document on its own, from a zero state, gives the same output: nothing crossed a boundary.
    for doc, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_doc, s_doc = kda_recurrent(*piece, output_final_state=True)
        assert rel_rms(o[:, start:end], o_doc) < 1e-10
        assert rel_rms(s[doc], s_doc[0]) < 1e-10


def test_packed_initial_states_per_document():
    q, k, v, g, beta = make_inputs(1, 50, 2, 4, 4, seed=2)
    cu = torch.tensor([0, 20, 50])
    h0 = torch.randn(2, 2, 4, 4, dtype=F64)
    o, s = kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_ref) < 1e-10 and rel_rms(s, s_ref) < 1e-10


def test_gradients_match_recurrence():
    inputs = [x.requires_grad_() for x in make_inputs(1, 70, 2, 8, 4, seed=3)]
    h0 = torch.randn(1, 2, 8, 4, dtype=F64, requires_grad=True)
    weight = torch.randn(1, 70, 2, 4, dtype=F64)
    grads = []
    for fn in (kda, kda_recurrent):
        o, s = fn(*inputs, initial_state=h0, output_final_state=True)
        ((o * weight).sum() + s.pow(2).sum()).backward()
        grads.append([x.grad.clone() for x in (*inputs, h0)])
        for x in (*inputs, h0):
            x.grad = None
    for name, got, want in zip(["q", "k", "v", "g", "beta", "h0"], *grads):
        assert rel_rms(got, want) < 1e-10, name


def test_gradcheck_finite_differences():
    # Chunk 16 over T=35: three chunks, two sub-blocks each, and a padded tail.
    inputs = [x.requires_grad_() for x in make_inputs(1, 35, 1, 4, 3, seed=4)]
    cu = torch.tensor([0, 12, 35])

    def fn(q, k, v, g, beta):
        o, s = kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, chunk_size=16)
        return o, s

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_fp32_strong_decay_stays_finite_and_close():
    # 64 steps at the lower bound: e^{-G} alone would overflow fp32 (e^320); the chunk form never forms it.
    q, k, v, _, beta = make_inputs(1, 128, 2, 16, 16, seed=5)
    g = torch.full_like(q, -5.0)
    o32, _ = kda(*(x.float() for x in (q, k, v, g, beta)))
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    assert torch.isfinite(o32).all()
    assert rel_rms(o32, o_ref) < 1e-5  # fp32 round-off


def test_bad_shapes_raise():
    q, k, v, g, beta = make_inputs(2, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="beta must be"):
        kda(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="B == 1"):
        kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="rise strictly"):
        kda(*(x[:1] for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 5, 5, 8]))


def test_initial_state_shape_is_checked():
    q, k, v, g, beta = make_inputs(2, 8, 2, 4, 3)
    with pytest.raises(ValueError, match=r"initial_state must be \[2, 2, 4, 3\]"):
        kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 3, 4, dtype=F64))


def pairwise_products(q, k, G):
    """The intra-chunk products straight from their definition: [..., C, C, K] exponents, float64."""
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).exp()  # [..., t, s, K]
    causal = torch.ones(G.shape[-2], G.shape[-2], dtype=torch.bool).tril()
    P = ((q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)) * causal
    A = ((k.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)) * causal
    return P, A


@pytest.mark.parametrize("sub", [1, 2, 4, 8, 16, 32, 64])
def test_intra_chunk_products_at_every_sub_block_size(sub):
    """Each factorisation through sub-block references equals the pairwise definition (float64, 1e-12);
    fp64 inputs always choose the whole chunk, so the smaller sizes are forced here."""
    from moe_pretrain.ops.kda import _BlockDecays, _intra_chunk_products

    q, k, _, g, _ = make_inputs(2, 64, 3, 8, 8, seed=6)
    G = g.movedim(2, 1).cumsum(-2)  # [B, H, C, K], one chunk
    q, k = q.movedim(2, 1), k.movedim(2, 1)
    got = _intra_chunk_products(q, k, _BlockDecays(G, sub))
    for a, b in zip(got, pairwise_products(q, k, G)):
        assert rel_rms(a, b) < 1e-12


@pytest.mark.parametrize(("lower", "expected"), [(-0.05, 64), (-1.0, 64), (-2.0, 32), (-5.0, 16)])
def test_sub_block_size_follows_the_decay(lower, expected):
    """fp32: mild decays take the whole chunk; the gate's strongest (-5 per token) needs 16 so that every
    factor stays within e^44 of its block's middle."""
    from moe_pretrain.ops.kda import _sub_block_size

    G = torch.full((1, 64, 16), lower).cumsum(-2)
    assert _sub_block_size(G) == expected


@pytest.mark.parametrize(("floor", "expected"), [(-1.0, 64), (-2.0, 32), (-5.0, 16), (-20.0, 4)])
def test_sub_block_size_from_the_gate_floor_reads_nothing(floor, expected):
    """With the gate's floor known the size is that of the worst decays the floor allows (G falling at the
    floor, the cases above), whatever G holds, and no value of G is read on the host."""
    from moe_pretrain.ops.kda import _sub_block_size
    from moe_pretrain.planning.host_reads import HostReads

    mild = torch.full((1, 64, 16), -0.01).cumsum(-2)
    with HostReads() as reads:
        size = _sub_block_size(mild, floor)
    assert size == expected and reads.total == 0
    assert _sub_block_size(torch.full((1, 64, 16), floor).cumsum(-2)) == expected


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_documents_in_one_pass_match_recurrence(chunk_size):
    """The training path (no initial or final states): all documents share the chunks of one sequence.
    Boundaries inside chunks, on a chunk edge (16, 64), single-token documents, a tail shorter than a
    chunk; outputs and gradients equal the recurrence to 1e-10 (float64)."""
    lengths = [16, 1, 1, 46, 64, 3, 29]
    T = sum(lengths)
    inputs = [x.requires_grad_() for x in make_inputs(1, T, 2, 8, 6, seed=7)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    weight = torch.randn(1, T, 2, 6, dtype=F64)
    results = []
    for fn in (kda, kda_recurrent):
        o, _ = fn(*inputs, cu_seqlens=cu, **({"chunk_size": chunk_size} if fn is kda else {}))
        results.append((o, torch.autograd.grad((o * weight).sum(), inputs)))
    (o, grads), (o_ref, grads_ref) = results
    assert rel_rms(o, o_ref) < 1e-10
    for name, got, want in zip(["q", "k", "v", "g", "beta"], grads, grads_ref):
        assert rel_rms(got, want) < 1e-10, name


def kda_live_peak(T: int, layout: str) -> int:
    """Peak live tensor bytes of KDA's forward + backward over T tokens: one document, or half of them in one
    and the rest as single-token documents."""
    lengths = [T] if layout == "one" else [T // 2] + [1] * (T // 2)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 32, generator=gen, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, T, 2, 32, generator=gen)).requires_grad_()
    beta = torch.rand(1, T, 2, generator=gen, requires_grad=True)
    with LiveTensorBytes() as live:
        kda(q, torch.nn.functional.normalize(k, dim=-1), v, g, beta, cu_seqlens=cu)[0].sum().backward()
    return live.peak


def test_packed_kda_memory_is_linear_in_t_whatever_the_documents():
    """4K tokens as one document against half of them as 2048 single-token documents: padding every
    document to the longest would need 2049 x 2048 positions (~1000x); one pass over shared chunks
    needs the same memory either way and doubling T twice the memory (measured exactly 1.0x and 2.0x: 36 and
    72 MB of live tensors, measured.LiveTensorBytes, the same on every machine)."""
    one, many, longer = kda_live_peak(4096, "one"), kda_live_peak(4096, "many"), kda_live_peak(8192, "many")
    assert many <= 1.05 * one, (one, many)
    assert longer <= 2.1 * many, (many, longer)
