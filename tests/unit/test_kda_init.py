"""KDA decay initialisation (docs/model.md, fla's): the initial per-step decays of a freshly built layer follow
exp(-5 (1 - e^-dt)) with log dt ~ U(log 1e-3, log 1e-1) under the bounded gate."""

import math

import torch

from moe_pretrain.config import KDAConfig
from moe_pretrain.model.init import initialize
from moe_pretrain.model.kda import DT_RANGE, KimiDeltaAttention


def fresh_layer(gate: str, heads: int = 16, head_dim: int = 128) -> KimiDeltaAttention:
    cfg = KDAConfig(num_heads=heads, head_dim=head_dim, gate=gate)
    return initialize(KimiDeltaAttention(64, cfg, norm_eps=1e-6, init_std=0.02, out_std=0.02), seed=0)


def decay_at_dt(dt: float) -> float:
    """The bounded gate's decay when f = 0 and A_log = 0: exp(-5 sigmoid(softplus^-1(dt))) = exp(-5 (1 - e^-dt))."""
    return math.exp(-5 * (1 - math.exp(-dt)))


def test_initial_decays_follow_fla_initialisation():
    layer = fresh_layer("lower_bound")
    assert torch.equal(layer.A_log, torch.zeros(16))
    with torch.no_grad():
        alpha = layer.decay(torch.zeros(1, 1, 16, 128)).exp().flatten().double()  # 2048 channels, f = 0
    low, high = (math.log(d) for d in DT_RANGE)
    # Quantile q of alpha is the decay at dt's quantile 1 - q (alpha falls as dt grows).
    for q in (0.1, 0.5, 0.9):
        expected = decay_at_dt(math.exp(low + (1 - q) * (high - low)))
        # 2048 draws: a quantile's standard error is under 0.01 of the dt range; 0.01 absolute is ~3 sigma.
        assert abs(torch.quantile(alpha, q).item() - expected) < 0.01, (q, expected)
    assert decay_at_dt(DT_RANGE[1]) <= alpha.min() and alpha.max() <= decay_at_dt(DT_RANGE[0])
    assert 0.6 < alpha.min() < 0.7 and 0.99 < alpha.max() < 0.996  # docs/model.md: about (0.6, 0.995)
    assert abs(alpha.median().item() - 0.9515) < 0.01


def test_softplus_gate_keeps_a_log_uniform_rate():
    layer = fresh_layer("softplus", heads=64)
    rate = layer.A_log.exp()
    assert 1 <= rate.min() and rate.max() <= 16 and rate.std() > 2  # spread over U(1, 16)
    dt = torch.nn.functional.softplus(layer.dt_bias.double())  # inverse of the initialisation: dt itself
    assert DT_RANGE[0] * 0.999 <= dt.min() and dt.max() <= DT_RANGE[1] * 1.001
