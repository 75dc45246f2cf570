"""A layout checked from the config and the world size alone, before any collective: messages name the keys,
and every stage's micro-batches are resolved (derived where the config leaves 0, kept and checked where it
states them)."""

import re

import pytest

from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.config.stage import derived_micro_batches, resolve_stages
from parallel.state import resolve_layout
from tests.models import TINY, tiny_config


@pytest.mark.parametrize(("world", "overrides", "message"), [
    (3, ["parallel.ep=2"], "parallel.ep=2 must divide the 3 ranks of a pipeline stage"),
    (4, ["model.moe.num_experts=6", "model.moe.top_k=2", "parallel.ep=4"],
     "model.moe.num_experts=6 is not divisible by parallel.ep=4"),
    (6, ["parallel.tp=4"], "world size 6 is not divisible by parallel.tp x parallel.pp x parallel.cp = 4 x 1 x 1"),
    (2, ["parallel.tp=2", "model.kda.num_heads=3"], "model.kda.num_heads=3 is not divisible by parallel.tp=2"),
    (8, ["parallel.pp=8", "model.num_layers=6"], "parallel.pp x parallel.vpp = 8 stages for model.num_layers=6"),
    (3, [], "data.batch_size=4 must be divisible by data-parallel size 3"),
    (2, ["parallel.tp=2", "model.vocab_size=265"], "model.vocab_size=265 is not divisible by parallel.tp=2"),
    (2, ["parallel.tp=2", "model.dense_intermediate=47"],
     "model.dense_intermediate=47 is not divisible by parallel.tp=2"),
    (2, ["parallel.tp=2", "data.seq_len=97"], "data.seq_len=97 is not divisible by parallel.tp=2"),
    (2, ["parallel.pp=2", "parallel.pipeline_layers=[2,3]"],
     "parallel.pipeline_layers=[2, 3] must hold 2 counts >= 1 (parallel.pp x parallel.vpp) summing to "
     "model.num_layers=6"),
    (2, ["parallel.pp=2", "parallel.vpp=2"], "parallel.vpp=2 needs parallel.pipeline_schedule=interleaved_1f1b"),
    (2, ["parallel.pp=2", "data.micro_batches=1"], "data.micro_batches=1 must be a multiple of parallel.pp=2"),
    (2, ["parallel.pp=2", "data.micro_batches=2", "model.moe.balancing=aux_loss"],
     "model.moe.balancing=aux_loss is not supported with parallel.pp > 1"),
    (1, ["parallel.cp=1", "parallel.vpp=1"], None),
    (2, ["parallel.cp=2", "data.seq_len=98"],
     "data.seq_len=98 is not divisible by 2 x parallel.cp x parallel.tp = 4 (two fragments per context-parallel"),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_mla=ulysses"],
     "parallel.cp=2 must divide the model.mla.num_heads=2 / parallel.tp=2 attention heads of a tensor-parallel rank "
     "with parallel.cp_mla=ulysses"),
    (4, ["parallel.cp=2", "parallel.tp=2"], None),  # auto: the latent exchange has no head cap
    (4, ["parallel.cp=2", "parallel.ep=2", "data.batch_size=4"], None),
])
def test_layout_errors_name_the_keys(world, overrides, message):
    if message is None:
        resolve_layout(tiny_config(*overrides), world)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_layout(tiny_config(*overrides), world)


def test_valid_folded_layouts():
    layout = resolve_layout(tiny_config("parallel.ep=2", "data.batch_size=8"), 4)
    assert (layout.dp, layout.ep, layout.edp) == (4, 2, 2)
    layout = resolve_layout(tiny_config("parallel.tp=2", "parallel.ep=2"), 2)  # experts over the tp ranks
    assert (layout.dp, layout.tp, layout.ep, layout.edp) == (1, 2, 2, 1)


def test_staged_runs_are_validated_on_their_stage_shapes():
    from tests.models import STAGES

    # data.batch_size is unused under a schedule: it must not be what decides the layout.
    layout = resolve_layout(tiny_config(STAGES, "train.steps=6", "data.batch_size=3"), 2)
    assert layout.dp == 2
    with pytest.raises(ConfigError, match=re.escape("stages[2]: 2 sequences per step must be divisible by "
                                                    "data-parallel size 4 x stages[2].micro_batches=1")):
        resolve_layout(tiny_config(STAGES, "train.steps=6"), 4)


@pytest.mark.parametrize(("world", "layout", "batch", "expected"), [
    (1, [], 8, 1), (2, ["parallel.pp=2"], 8, 2), (4, ["parallel.pp=2"], 8, 2), (4, ["parallel.pp=4"], 8, 4),
    (2, ["parallel.pp=2"], 6, 2), (8, ["parallel.pp=2"], 24, 2), (4, ["parallel.pp=2", "parallel.tp=2"], 4, 2),
])
def test_micro_batches_are_derived_when_unset(world, layout, batch, expected):
    cfg = load_config("configs/smoke.yaml", [*TINY, *layout, f"data.batch_size={batch}", "model.num_layers=6"])
    assert cfg.data.micro_batches == 0
    chosen = derived_micro_batches(cfg, resolve_stages(cfg))
    assert [stage.micro_batches for stage in resolve_stages(cfg)] == [expected]
    assert chosen and f"data.micro_batches={expected}" in chosen[0]
    assert [stage.micro_batches for stage in resolve_layout(cfg, world).stages] == [expected]  # valid
    assert cfg.data.micro_batches == 0  # the config is read, not changed


def test_micro_batches_for_stages_and_when_none_fits():
    stages = "stages=[{tokens: 64, seq_len: 8, batch_tokens: 32}, {tokens: 64, seq_len: 16, batch_tokens: 64}]"
    cfg = load_config("configs/full.yaml", ["parallel.pp=4", stages, "train.steps=3"])
    resolved = resolve_stages(cfg)
    assert [stage.micro_batches for stage in resolved] == [4, 4]
    assert derived_micro_batches(cfg, resolved) == [f"stages[{i}].micro_batches=4 (the smallest count for "
                                                    "parallel.pp=4: one round)" for i in (0, 1)]
    odd = load_config("configs/smoke.yaml", [*TINY, "parallel.pp=2", "data.batch_size=3"])
    with pytest.raises(ConfigError, match=r"data.batch_size=3 must be divisible by data-parallel size 1 x "
                                          r"data.micro_batches=2"):
        resolve_layout(odd, 2)


def test_an_explicit_micro_batch_count_is_kept_and_checked():
    cfg = load_config("configs/smoke.yaml", [*TINY, "parallel.pp=2", "data.micro_batches=1"])
    assert resolve_stages(cfg)[0].micro_batches == 1 and derived_micro_batches(cfg, resolve_stages(cfg)) == []
    with pytest.raises(ConfigError, match=r"data\.micro_batches=1 must be a multiple of parallel\.pp=2"):
        resolve_layout(cfg, 2)
