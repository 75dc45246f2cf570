"""Config loading, overrides and the errors users see."""

from pathlib import Path

import pytest

from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.config.model import FULL_LAYER_PATTERN
from moe_pretrain.config.reference import reference_markdown
from tests.models import EVAL_OFF


def test_smoke_and_full_configs_load():
    smoke = load_config("configs/smoke.yaml")
    assert smoke.model.hidden_size == 128 and smoke.model.moe.num_experts == 16
    full = load_config("configs/full.yaml")
    assert full.model.layer_pattern == FULL_LAYER_PATTERN
    mla_positions = [i + 1 for i, c in enumerate(full.model.layer_pattern) if c == "M"]
    assert mla_positions == [*range(4, 93, 4), 93]  # docs/model.md: 4, 8, ..., 92 and 93
    assert full.model.layer_pattern.count("K") == 69


def test_overrides_are_typed():
    cfg = load_config("configs/smoke.yaml", ["train.steps=20", "model.moe.num_experts=8", "optim.lr=1e-3",
                                             "model.moe.balancing=aux_free", "logging.progress=false"])
    assert cfg.train.steps == 20 and cfg.model.moe.num_experts == 8
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.model.moe.balancing == "aux_free" and cfg.logging.progress is False


def test_an_unknown_key_or_a_mistyped_value_names_the_layer_it_came_from(tmp_path):
    layer = tmp_path / "cluster.yaml"
    layer.write_text("model:\n  hiden_size: 32\n")
    with pytest.raises(ConfigError, match=rf"unknown config key model\.hiden_size; did you mean model\.hidden_size\? "
                                          rf"\(from config file {layer}\)$"):
        load_config(["configs/smoke.yaml", layer])
    with pytest.raises(ConfigError, match=r"unknown config key train\.stepz; .* \(from the command line\)$"):
        load_config("configs/smoke.yaml", ["train.stepz=3"])
    layer.write_text("model:\n  hidden_size: abc\n")
    with pytest.raises(ConfigError, match=rf"^model\.hidden_size='abc' has type str, expected int \(from config file "
                                          rf"{layer}\)$"):
        load_config(["configs/smoke.yaml", layer])


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
    ("model.layer_pattern=KKKXKKKM", "model.layer_pattern may hold only K (kda), M (mla), found ['X']"),
    ("model.attn_res.block_size=0", "model.attn_res.block_size=0 must be >= 1"),
    ("data.batch_size=6", "data.batch_size=6 must be divisible by data.micro_batches=4"),
    ("data.image_size=30", "data.image_size=30 must be a multiple of 2 x model.vision.patch_size x "
                           "model.vision.encoder.merge = 56"),
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


@pytest.mark.parametrize(("overrides", "enabled_by", "message"), [
    (["eval.every=2"], ["eval.tokens=4096"], "eval.every=2 does nothing: evaluation is off (eval.tokens=0): set "
                                             "eval.tokens"),
    (["eval.probe_samples=2"], ["eval.tokens=4096"], "eval.probe_samples=2 does nothing: evaluation is off"),
    (["model.mla.rope_theta=500000"], ["model.mla.position=rope"],
     "model.mla.rope_theta=500000.0 does nothing: MLA rotates nothing with model.mla.position=nope"),
    (["model.kda.lower_bound=-4"], ["model.kda.gate=lower_bound"], None),
    (["model.kda.gate=softplus", "model.kda.lower_bound=-4"], ["model.kda.gate=lower_bound"],
     "model.kda.lower_bound=-4.0 does nothing: the decay has no floor with model.kda.gate=softplus"),
    (["precision.fp8_amax_history=4"], ["precision.fp8=delayed"],
     "precision.fp8_amax_history=4 does nothing: only precision.fp8=delayed keeps amax histories"),
    (["model.moe.balancing=aux_free", "model.moe.qb_rate=0.5"], ["model.moe.balancing=qb"],
     "model.moe.qb_rate=0.5 does nothing: it is quantile balancing's rate"),
    (["model.moe.aux_loss_coef=0.1"], ["model.moe.balancing=aux_loss"], "model.moe.aux_loss_coef=0.1 does nothing"),
    (["parallel.vpp=2", "parallel.pipeline_schedule=interleaved_1f1b"], ["parallel.pp=2"],
     "parallel.vpp=2 does nothing: there is no pipeline with parallel.pp=1; parallel.pipeline_schedule="
     "interleaved_1f1b does nothing"),
    (["parallel.cp_mla=latent"], ["parallel.cp=2"],
     "parallel.cp_mla=latent does nothing: MLA exchanges nothing without context parallelism"),
    (["logging.straggler.every=0", "parallel.ranks_per_node=2"], ["parallel.expert_dispatch=node"],
     "parallel.ranks_per_node=2 does nothing: it cuts expert-parallel groups by node"),
    (["train.recompute_exchanges=false"], ["train.recompute=full", "parallel.ep=2"],
     "train.recompute_exchanges=false does nothing: only full recomputation"),
    (["data.long_doc_tokens=128"], ["data.long_doc_share=0.5"],
     "data.long_doc_tokens=128 does nothing: no long_doc_share draws from long documents"),
])
def test_settings_that_act_only_with_another_are_refused_alone(overrides, enabled_by, message):
    """A setting whose effect needs another one that is off is refused at start naming both (it used to run
    without it, silently); with the other turned on it loads."""
    if message is None:  # the default gate takes its floor: nothing to refuse
        load_config("configs/smoke.yaml", overrides)
    else:
        with pytest.raises(ConfigError) as err:
            load_config("configs/smoke.yaml", [*EVAL_OFF, *overrides])
        assert message in str(err.value)
    load_config("configs/smoke.yaml", [*overrides, *enabled_by])


def test_stage_rope_base_needs_rope():
    stage = ("stages=[{name: a, tokens: 4096, seq_len: 256, batch_tokens: 2048, rope_theta: 500000}]",
             "train.steps=2")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.rope_theta=500000.0? does nothing"):
        load_config("configs/smoke.yaml", stage)
    assert load_config("configs/smoke.yaml", [*stage, "model.mla.position=rope"]).stages[0].rope_theta == 500000


def test_stage_mla_exchange_needs_the_stage_to_run_context_parallel():
    stage = "stages=[{name: a, tokens: 4096, seq_len: 256, batch_tokens: 2048, cp_mla: latent}]"
    with pytest.raises(ConfigError, match=r"stages\[0\]\.cp_mla=latent does nothing"):
        load_config("configs/smoke.yaml", [stage, "train.steps=2"])
    with_cp = "stages=[{name: a, tokens: 4096, seq_len: 256, batch_tokens: 2048, cp_mla: latent, cp: 2}]"
    assert load_config("configs/smoke.yaml", [with_cp, "train.steps=2"]).stages[0].cp_mla == "latent"


def test_stage_long_document_threshold_needs_a_share():
    stage = "stages=[{name: a, tokens: 4096, seq_len: 256, batch_tokens: 2048, long_doc_tokens: 128}]"
    with pytest.raises(ConfigError, match=r"stages\[0\]\.long_doc_tokens=128 does nothing"):
        load_config("configs/smoke.yaml", [stage, "train.steps=2"])
    load_config("configs/smoke.yaml", [stage, "train.steps=2", "data.long_doc_share=0.5"])


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


def test_the_configuration_reference_is_generated_from_the_code_and_documents_every_key():
    """docs/config_reference.md is what moe_pretrain.config.reference writes (a key added, renamed or re-documented
    without regenerating the page fails here), and every key has a docstring under its field."""
    page = Path("docs/config_reference.md").read_text()
    assert page == reference_markdown(), \
        "docs/config_reference.md is stale: python -m moe_pretrain.config.reference > docs/config_reference.md"
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    keys = {row.split("`")[1] for row in rows}
    assert {"model.moe.top_k", "parallel.expert_dispatch", "train.recompute_exchanges", "stages[i].cp",
            "data.blend[i].weight", "logging.wandb.project"} <= keys
    assert [row.split("|")[1] for row in rows if row.rstrip().endswith("|  |")] == []
