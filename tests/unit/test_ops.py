"""SiTU-GLU, AttnRes mix, routing and balancing rules against direct computations."""

import numpy as np
import pytest
import torch

from moe_pretrain.ops import (
    attn_res_mix,
    aux_free_update,
    expert_load,
    load_balancing_loss,
    quantile_balance_update,
    route,
    situ_glu,
)
from tests.helpers import rel_rms

F64 = torch.float64


def test_situ_glu_values():
    gate = torch.tensor([-3.0, 0.0, 0.5, 10.0], dtype=F64)
    up = torch.tensor([2.0, 1.0, -40.0, 100.0], dtype=F64)
    expected = [
        4 * np.tanh(g / 4) * (1 / (1 + np.exp(-g))) * 25 * np.tanh(u / 25)
        for g, u in zip(gate.tolist(), up.tolist())
    ]
    assert torch.allclose(situ_glu(gate, up), torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


def test_situ_glu_is_bounded_by_100():
    gate = torch.linspace(-1e4, 1e4, 20001, dtype=F64)
    up = torch.linspace(1e4, -1e4, 20001, dtype=F64)
    assert situ_glu(gate, up).abs().max() <= 100.0
    far = torch.tensor(1e6, dtype=F64)
    assert situ_glu(far, far).item() == pytest.approx(100.0, rel=1e-12)


def test_situ_glu_gradcheck():
    gate = torch.randn(5, 7, dtype=F64, requires_grad=True) * 3
    up = torch.randn(5, 7, dtype=F64, requires_grad=True) * 30
    assert torch.autograd.gradcheck(situ_glu, (gate.detach().requires_grad_(), up.detach().requires_grad_()))


def test_situ_glu_gradients_match_the_formula_autograd():
    """The saved-inputs backward against autograd through docs/model.md's formula (float64, 1e-12)."""
    gate = (torch.randn(64, 33, dtype=F64) * 4).requires_grad_()
    up = (torch.randn(64, 33, dtype=F64) * 40).requires_grad_()
    grad = torch.randn(64, 33, dtype=F64)
    formula = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * (25.0 * torch.tanh(up / 25.0))
    expected = torch.autograd.grad(formula, (gate, up), grad)
    got = torch.autograd.grad(situ_glu(gate, up), (gate, up), grad)
    for a, b in zip(got, expected):
        assert rel_rms(a, b) < 1e-12


def test_situ_glu_runs_fp32_inside_bf16():
    gate = torch.randn(64, dtype=torch.bfloat16)
    up = torch.randn(64, dtype=torch.bfloat16)
    out = situ_glu(gate, up)
    assert out.dtype == torch.bfloat16
    ref = situ_glu(gate.double(), up.double())
    assert rel_rms(out, ref) < 1e-2  # only the final bf16 rounding


def test_attn_res_mix_matches_loop():
    gen = torch.Generator().manual_seed(0)
    bank = torch.randn(5, 3, 4, 16, generator=gen, dtype=F64) * torch.rand(5, 1, 1, 1, generator=gen, dtype=F64) * 5
    query = torch.randn(16, generator=gen, dtype=F64)
    norm_weight = torch.rand(16, generator=gen, dtype=F64) + 0.5
    out = attn_res_mix(list(bank), query, norm_weight, eps=1e-5)
    expected = torch.zeros(3, 4, 16, dtype=F64)
    for b in range(3):
        for t in range(4):
            scores = []
            for i in range(5):
                vec = bank[i, b, t]
                normed = vec / torch.sqrt(vec.pow(2).mean() + 1e-5) * norm_weight
                scores.append(float(normed @ query))  # no 1/sqrt(d)
            weights = np.exp(np.array(scores) - max(scores))
            weights /= weights.sum()
            expected[b, t] = sum(float(w) * bank[i, b, t] for i, w in enumerate(weights))
    assert rel_rms(out, expected) < 1e-12


def test_route_selects_by_biased_scores_and_normalises_raw_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=F64)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9], dtype=F64)
    idx, weight = route(logits, bias, k=2, scaling=2.5)
    scores = torch.sigmoid(logits)
    # Token 0: biased scores 0.88, 0.73, 0.5, 0.17+0.9=1.17 -> experts {3, 0}.
    assert sorted(idx[0].tolist()) == [0, 3]
    assert sorted(idx[1].tolist()) == [2, 3]
    assert torch.allclose(weight.sum(-1), torch.full((2,), 2.5, dtype=F64))
    raw = scores.gather(1, idx)
    assert torch.allclose(weight, raw / raw.sum(-1, keepdim=True) * 2.5)  # bias never enters the weights


def direct_qb(scores: np.ndarray, bias: np.ndarray, k: int, rate: float) -> np.ndarray:
    """docs/model.md's rule spelled out with numpy sorts."""
    m, n = scores.shape
    biased = scores + bias
    alpha = np.array([sorted(row, reverse=True)[k] for row in biased])
    margins = biased - alpha[:, None]
    q = m * k // n
    c = np.array([sorted(margins[:, j], reverse=True)[q] for j in range(n)])
    return bias - rate * c


@pytest.mark.parametrize(("m", "n", "k", "rate"), [(96, 8, 2, 1.0), (50, 7, 3, 0.5), (13, 16, 4, 1.0)])
def test_quantile_balance_update_follows_the_rule(m, n, k, rate):
    gen = torch.Generator().manual_seed(m + n)
    scores = torch.rand(m, n, generator=gen, dtype=F64)
    bias = torch.randn(n, generator=gen, dtype=F64) * 0.1
    got = quantile_balance_update(scores, bias, k, rate)
    want = direct_qb(scores.numpy(), bias.numpy(), k, rate)
    assert np.allclose(got.numpy(), want, rtol=0, atol=1e-15)


def test_quantile_balance_threshold_is_the_column_quantile():
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(96, 8, generator=gen, dtype=F64)
    bias = torch.randn(8, generator=gen, dtype=F64) * 0.2
    new = quantile_balance_update(scores, bias, 2)
    alpha = torch.topk(scores + bias, 3, dim=1).values[:, 2:]
    margins = scores + bias - alpha
    threshold = bias - new  # c_j
    q = 96 * 2 // 8
    # c_j is the (q+1)-th largest margin: at most q margins lie strictly above it, at least q+1 at or above.
    # (Ties occur: a token whose (k+1)-th choice is j has margin exactly 0 in column j.)
    assert ((margins > threshold).sum(0) <= q).all()
    assert ((margins >= threshold).sum(0) >= q + 1).all()


def test_quantile_balance_cuts_skew_by_half():
    gen = torch.Generator().manual_seed(3)
    m, n, k = 96, 8, 2
    skew = torch.linspace(2.0, -2.0, n, dtype=F64)  # expert 0 strongly preferred
    logits = torch.randn(m, n, generator=gen, dtype=F64) + skew
    scores = torch.sigmoid(logits)
    bias = torch.zeros(n, dtype=F64)
    target = m * k / n

    def max_deviation(b):
        idx, _ = route(logits, b, k)
        return float((expert_load(idx, n).double() - target).abs().max())

    before = max_deviation(bias)
    after = max_deviation(quantile_balance_update(scores, bias, k))
    assert before >= 20, before  # the batch really is skewed
    assert after <= before / 2, (before, after)


def test_aux_free_update_moves_toward_mean_load():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # loads 4, 2, 1, 1 (mean 2)
    new = aux_free_update(expert_load(idx, 4), torch.zeros(4, dtype=F64), rate=0.01)
    assert new.tolist() == [-0.01, 0.0, 0.01, 0.01]


def test_load_balancing_loss_is_one_when_balanced():
    scores = torch.full((8, 4), 0.5, dtype=F64)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(scores, idx).item() == pytest.approx(1.0)
    # All load on experts 0 and 1, which also hold 90% of the score mass: n * sum f P = 4 * 0.45 = 1.8.
    peaked = torch.tensor([[0.9, 0.9, 0.1, 0.1]] * 8, dtype=F64)
    skewed = torch.tensor([[0, 1]] * 8)
    assert load_balancing_loss(peaked, skewed).item() == pytest.approx(1.8)


@pytest.mark.parametrize("implementation, dtype, bound", [("loop", torch.float64, 1e-12),
                                                        ("grouped", torch.float32, 1e-6)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 9, 0, 0]])
def test_grouped_mm_matches_per_expert_matmuls_forward_and_backward(implementation, dtype, bound, counts):
    """Both implementations (per-expert loop; torch._grouped_mm) against x_e @ W_e^T per expert in float64, on
    ragged groups with empty experts (and no rows at all): relative RMS within 1e-12 (float64 loop) and 1e-6
    (fp32 grouped kernel); an expert with no rows gets an exactly zero weight gradient."""
    from moe_pretrain.ops import grouped_mm

    torch.manual_seed(0)
    x64 = torch.randn(sum(counts), 8, dtype=torch.float64)
    w64 = torch.randn(4, 12, 8, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    w = w64.to(dtype).requires_grad_()
    y = grouped_mm(x, w, torch.tensor(counts), implementation)
    x64.requires_grad_()
    w64.requires_grad_()
    reference = torch.cat([part @ w64[e].T for e, part in enumerate(torch.split(x64, counts))])
    grad = torch.randn(reference.shape, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w), grad.to(dtype))
    expected = torch.autograd.grad(reference, (x64, w64), grad)
    for a, b in zip((y, *got), (reference, *expected)):
        assert a.dtype == dtype and a.shape == b.shape
        assert (b.abs().sum() == 0 and a.abs().sum() == 0) or rel_rms(a.double(), b) < bound
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(got[1][e], torch.zeros(12, 8, dtype=dtype))


def test_grouped_mm_rejects_bad_counts_and_an_impossible_forced_kernel():
    from moe_pretrain.ops import grouped_mm

    x, w = torch.randn(4, 6), torch.randn(2, 8, 6)
    with pytest.raises(ValueError, match="sum to"):
        grouped_mm(x, w, torch.tensor([1, 1]), "loop")
    with pytest.raises(ValueError, match=r"kernels\.grouped_gemm=grouped cannot run: in width 6"):
        grouped_mm(x, w, torch.tensor([1, 3]), "grouped")
