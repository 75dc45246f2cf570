"""Newton-Schulz orthogonalisation (Muon's update) against a float64 SVD: the result has the input's singular
vectors and its singular values in the band the quintic coefficients give; per-head blocks are orthogonalised
independently; the update's RMS is Moonlight's 0.2."""

import pytest
import torch

from moe_pretrain.ops.newton_schulz import muon_update, orthogonalize

BAND = (0.6, 1.25)
"""Singular values after 5 steps of the (3.4445, -4.7750, 2.0315) quintic, for every singular value of at least
LIFTED x the Frobenius norm (measured 0.68-1.20 over the shapes below). Smaller ones are in the iteration's linear
regime and grow by a^5 = 3.4445^5 ~ 485 (a square random matrix has some: its smallest is ~1/n^2 of the norm)."""
LIFTED = 2e-3


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (3, 48, 80)])
def test_singular_values_land_in_the_band_with_the_inputs_singular_vectors(shape):
    m = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = orthogonalize(m)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    # In the input's singular basis the result is diagonal (up to float64 round-off): same vectors, new values.
    inner = u.mT @ o @ vh.mT
    diagonal = torch.diagonal(inner, dim1=-2, dim2=-1)
    assert (inner - torch.diag_embed(diagonal)).abs().max() < 1e-10
    relative = s / torch.linalg.matrix_norm(m, keepdim=True).squeeze(-1)
    lifted = relative >= LIFTED
    assert lifted.float().mean() > 0.9
    assert BAND[0] <= float(diagonal[lifted].min()) and float(diagonal.max()) <= BAND[1], diagonal
    assert (diagonal[~lifted] >= 0.9 * 3.4445 ** 5 * relative[~lifted]).all()
    # float32 and bf16 inputs agree with the float64 result to their precision.
    assert (orthogonalize(m.float()).double() - o).abs().max() < 1e-4
    assert (orthogonalize(m.bfloat16()).double() - o).abs().max() < 0.05


def test_heads_are_orthogonalised_block_by_block():
    torch.manual_seed(1)
    per_head = [torch.randn(16, 64, dtype=torch.float64) * scale for scale in (1.0, 100.0, 0.01)]
    stacked = muon_update(torch.cat(per_head), heads=3)
    for h, block in enumerate(per_head):
        assert torch.allclose(stacked[16 * h:16 * (h + 1)], muon_update(block), atol=1e-12)
    # One head's scale does not set another's: every head's update has about the same RMS.
    rms = [float(stacked[16 * h:16 * (h + 1)].pow(2).mean().sqrt()) for h in range(3)]
    assert max(rms) / min(rms) < 1.05


def test_update_rms_matches_adamws_typical_update():
    m = torch.randn(256, 512, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rms = float(muon_update(m).pow(2).mean().sqrt())
    assert 0.2 * 0.75 < rms < 0.2 * 1.15  # 0.2 x the RMS of an orthogonal-ish matrix scaled by sqrt(max side)


def test_heads_must_split_the_rows():
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        muon_update(torch.zeros(16, 8), heads=3)


def test_each_step_is_three_products_with_their_sums_folded_in():
    """A step is X X^T, then b G + c G G and a X + (that) X as two baddbmm: three launches, no elementwise pass
    over X or the Gram matrix (the op census's count), and the result is the quintic's, step by step, in float64."""
    from moe_pretrain.ops.newton_schulz import COEFFICIENTS, STEPS
    from moe_pretrain.planning.op_census import OpCensus

    m = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with OpCensus() as ops:
        o = orthogonalize(m)
    steps = {name: n for name, n in ops.launches_by_op.items() if name in ("bmm", "baddbmm")}
    assert steps == {"bmm": STEPS, "baddbmm": 2 * STEPS}, ops.launches_by_op
    x = m / (torch.linalg.matrix_norm(m, keepdim=True) + 1e-7)
    a, b, c = COEFFICIENTS
    for _ in range(STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    assert torch.allclose(o, x, rtol=0, atol=1e-12)
