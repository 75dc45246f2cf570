"""Config loading, overrides and the errors users see."""

import pytest

from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.config.model import FULL_LAYER_PATTERN


def test_smoke_and_full_configs_load():
    smoke = load_config("configs/smoke.yaml")
    assert smoke.model.hidden_size == 128 and smoke.model.moe.num_experts == 16
    full = load_config("configs/full.yaml")
    assert full.model.layer_pattern == FULL_LAYER_PATTERN
    mla_positions = [i + 1 for i, c in enumerate(full.model.layer_pattern) if c == "M"]
    assert mla_positions == [*range(4, 93, 4), 93]  # MODEL.md: 4, 8, ..., 92 and 93
    assert full.model.layer_pattern.count("K") == 69


def test_overrides_are_typed():
    cfg = load_config("configs/smoke.yaml", ["train.steps=20", "model.moe.num_experts=8", "optim.lr=1e-3",
                                             "model.moe.balancing=aux_free", "logging.progress=false"])
    assert cfg.train.steps == 20 and cfg.model.moe.num_experts == 8
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.model.moe.balancing == "aux_free" and cfg.logging.progress is False


@pytest.mark.parametrize(("override", "message"), [
    ("model.num_experts=8", "unknown config key model.num_experts; did you mean model.moe.num_experts?"),
    ("trian.steps=3", "unknown config key trian; did you mean train?"),
    ("model.moe.topk=3", "did you mean model.moe.top_k?"),
    ("model.hidden_size=abc", "model.hidden_size='abc' has type str, expected int"),
    ("train.steps=2.5", "train.steps=2.5 has type float, expected int"),
    ("logging.progress=3", "logging.progress=3 has type int, expected bool"),
    ("model.moe.balancing=foo", "model.moe.balancing='foo' must be one of 'qb', 'aux_free', 'aux_loss'"),
    ("model.moe.top_k=16", "model.moe.top_k=16 must be < model.moe.num_experts=16"),
    ("model.num_layers=7", "model.layer_pattern has 8 letters but model.num_layers=7"),
    ("model.layer_pattern=KKKXKKKM", "model.layer_pattern may hold only K (KDA) and M (MLA)"),
    ("model.attn_res.block_size=0", "model.attn_res.block_size=0 must be >= 1"),
    ("data.batch_size=6", "data.batch_size=6 must be divisible by data.micro_batches=4"),
    ("data.image_size=30", "data.image_size=30 must be a multiple of model.vision.patch_size=14"),
    ("optim.min_lr=1.0", "optim.min_lr=1.0 must be in [0, optim.lr="),
    ("train", "override 'train' must look like section.key=value"),
    ("train.exit_at_step=999", "train.exit_at_step=999 must be in [0, train.steps=150]"),
    ("checkpoint.keep_last=1", "checkpoint.keep_last=1 must be >= 2"),
    ("model.moe=3", "model.moe must be a mapping of keys"),
])
def test_bad_values_name_their_keys(override, message):
    extra = ["data.micro_batches=4"] if override.startswith("data.batch_size") else []
    with pytest.raises(ConfigError) as err:
        load_config("configs/smoke.yaml", [*extra, override])
    assert message in str(err.value)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_yaml_exponent_without_dot_is_read_as_float(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 1e-3\n  min_lr: 1e-4\n")  # YAML 1.1 reads these as strings
    assert load_config(f).optim.lr == pytest.approx(1e-3)
