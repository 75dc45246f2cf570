"""The released Kimi K3 config.json (tests/assets/kimi_k3_release_config.json, the public file as published) maps
onto our full-size model key for key, and our export writes the release's values for every key that shapes the
model; values our model cannot represent are refused naming the key."""

import copy
import json
from pathlib import Path

import pytest

from moe_pretrain.checkpoint.kimi_k3_config import model_section, release_config
from moe_pretrain.config import ConfigError, load_config

RELEASE = json.loads((Path(__file__).parents[1] / "assets" / "kimi_k3_release_config.json").read_text())


def _get(model, dotted: str):
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


def test_the_release_config_is_our_full_size_model():
    values, quantized, notes = model_section(RELEASE)
    assert quantized
    full = load_config("configs/full.yaml").model
    imported = load_config(None, values=values).model
    assert {key: _get(imported, key.removeprefix("model.")) for key in values} == {
        key: _get(full, key.removeprefix("model.")) for key in values}
    assert len(values) >= 35 and imported.layer_pattern == full.layer_pattern
    # What was read but not mapped is said, not dropped: the token ids and the generation settings.
    assert "media_placeholder_token_id=163605" in notes
    assert "text_config.max_position_embeddings" in notes[-1] and "text_config.top_k" in notes[-1]


def test_our_export_config_writes_the_release_values():
    ours = release_config(load_config("configs/full.yaml").model, quantized=True)
    assert ours["architectures"] == RELEASE["architectures"] and ours["model_type"] == RELEASE["model_type"]
    for section in ("text_config", "vision_config"):
        differing = {key: (value, RELEASE[section].get(key)) for key, value in ours[section].items()
                     if RELEASE[section].get(key, value) != value}
        assert not differing, (section, differing)
    # Every key the import maps is written, so a loader never falls back to a default.
    values, _, _ = model_section(ours)
    assert values == model_section(RELEASE)[0]
    assert "quantization_config" not in release_config(load_config("configs/full.yaml").model, False)["text_config"]


@pytest.mark.parametrize("key, value, named", [
    ("num_nextn_predict_layers", 1, "text_config.num_nextn_predict_layers=1"),
    ("mla_use_output_gate", False, "text_config.mla_use_output_gate=False"),
    ("hidden_act", "silu", "text_config.hidden_act='silu'"),
    ("num_key_value_heads", 8, "text_config.num_key_value_heads=8"),
    ("num_expert_group", 8, "text_config.num_expert_group=8"),
])
def test_what_the_model_cannot_represent_is_refused_by_name(key, value, named):
    release = copy.deepcopy(RELEASE)
    release["text_config"][key] = value
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        model_section(release)


def test_a_layer_list_that_does_not_split_the_layers_is_refused():
    release = copy.deepcopy(RELEASE)
    release["text_config"]["linear_attn_config"]["kda_layers"].remove(5)
    with pytest.raises(ConfigError, match=r"kda_layers / full_attn_layers=\[5\]"):
        model_section(release)
