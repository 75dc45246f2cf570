"""Layout-independent initialisation by pieces: a shard draws exactly its slice of the whole, a stream depends on
the seed and the parameter's name alone, the distributions are what they claim, and the full-size model builds on
the meta device."""

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.model.counts import count
from moe_pretrain.model.init import Constant, InverseSoftplusLogUniform, Normal, Uniform, draw
from moe_pretrain.model.meta import meta_model
from parallel.parallelize import describe_parameters


@pytest.mark.parametrize("shape", [(6, 10), (4, 3, 5), (7,)])
def test_every_box_draws_its_slice_of_the_whole(shape):
    whole = draw(Normal(1.0), 5, "w", shape)
    for dim in range(len(shape)):
        for start, size in ((0, 1), (1, shape[dim] - 2), (shape[dim] - 1, 1)):
            offsets = [0] * len(shape)
            sizes = list(shape)
            offsets[dim], sizes[dim] = start, size
            box = draw(Normal(1.0), 5, "w", shape, tuple(offsets), tuple(sizes))
            assert torch.equal(box, whole.narrow(dim, start, size))
    inner = draw(Normal(1.0), 5, "w", shape, (1,) * len(shape), tuple(s - 2 for s in shape))
    assert torch.equal(inner, whole[tuple(slice(1, s - 1) for s in shape)])


def test_streams_depend_on_seed_and_name_only():
    a = draw(Normal(0.02), 0, "layers.0.mlp.experts.w_up", (64, 64))
    assert torch.equal(a, draw(Normal(0.02), 0, "layers.0.mlp.experts.w_up", (64, 64)))
    assert not torch.equal(a, draw(Normal(0.02), 1, "layers.0.mlp.experts.w_up", (64, 64)))
    assert not torch.equal(a, draw(Normal(0.02), 0, "layers.1.mlp.experts.w_up", (64, 64)))


def test_distributions():
    n = (200_000,)
    normal = draw(Normal(0.02), 0, "n", n)
    # 2e5 draws: the sample std's standard error is 0.02 / sqrt(4e5) = 3e-5; mean's is 4.5e-5.
    assert abs(normal.std().item() - 0.02) < 2e-4 and abs(normal.mean().item()) < 3e-4
    assert torch.isfinite(normal).all()
    uniform = draw(Uniform(-0.5, 0.5), 0, "u", n)
    assert -0.5 < uniform.min() and uniform.max() < 0.5 and abs(uniform.mean().item()) < 0.005
    dt = torch.nn.functional.softplus(draw(InverseSoftplusLogUniform(1e-3, 1e-1), 0, "dt", n))
    assert 1e-3 * 0.999 < dt.min() and dt.max() < 1e-1 * 1.001
    assert abs(dt.log().mean().item() - (torch.tensor(1e-3).log() + torch.tensor(1e-1).log()).item() / 2) < 0.02
    assert torch.equal(draw(Constant(1.0), 0, "c", (3,)), torch.ones(3, dtype=torch.float64))


@pytest.mark.timeout(120)
def test_full_size_model_builds_on_meta():
    """The full-size model on the meta device holds the parameters model/counts.py counts, each described."""
    cfg = load_config("configs/full.yaml")
    model = meta_model(cfg.model)
    parameters = describe_parameters(model)
    total = sum(p.numel() for p in model.parameters())
    assert total == count(cfg.model, cfg.data.seq_len)["total_params"]
    assert all(p.is_meta for p in model.parameters()) and len(parameters) == len(list(model.parameters()))
