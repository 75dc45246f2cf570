"""Layout-independent initialisation: every layout's gathered initial model equals the single-process one
bitwise (the draws by pieces: tests/unit/test_init.py)."""


import pytest
import torch

from launch.local import run_distributed
from parallel.parallelize import build_model, gather_full_state
from parallel.state import destroy_parallel, init_parallel
from tests.models import tiny_config


def init_config(*overrides):
    return tiny_config("train.dtype=float64", "logging.progress=false", *overrides)


def gathered_initial_state(rank, world_size, overrides):
    cfg = init_config(*overrides)
    ctx = init_parallel(cfg)
    try:
        model = build_model(cfg, ctx)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        local = sum(p.numel() for p in model.parameters())
        return gather_full_state(model, ctx), local
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "overrides"), [
    (2, ["parallel.pp=2"]),
    (4, ["parallel.ep=4"]),
    (4, ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2"]),
], ids=["pp2", "ep4", "tp2xpp2xep2"])
def test_initial_model_is_bitwise_the_same_on_every_layout(world_size, overrides):
    reference = build_model(init_config()).state_dict()
    state, local = run_distributed(gathered_initial_state, world_size, overrides)
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    assert local < sum(t.numel() for name, t in reference.items() if "expert_bias" not in name)


