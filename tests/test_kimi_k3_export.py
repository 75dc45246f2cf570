"""Export to the released Kimi K3 layout and import back: names and shapes at full size (meta tensors),
and a smoke checkpoint's round trip (identical logits, identical files)."""

import json
import math

import pytest
import torch
import yaml
from safetensors import safe_open

from moe_pretrain.checkpoint import verify
from moe_pretrain.checkpoint.export import export
from moe_pretrain.checkpoint.kimi_k3 import A_LOG_MULTIPLE, LM_HEAD, PREFIX, kimi_k3_tensors
from moe_pretrain.config import config_to_dict, load_config
from moe_pretrain.data import PretrainingData
from moe_pretrain.training import Trainer
from moe_pretrain.training.parallelize import meta_model
from parallel.image_split import placed_images
from tests.models import tiny_config
from tests.test_checkpoints_tool import tool

# Published tensor tables of the release (layer 1: KDA mixer, routed MoE), and the other names it uses.
RELEASED_LAYER_1 = {
    "self_attention_res_norm.weight": ("BF16", (7168,)), "self_attention_res_proj.weight": ("BF16", (1, 7168)),
    "input_layernorm.weight": ("BF16", (7168,)),
    "self_attn.q_proj.weight": ("BF16", (12288, 7168)), "self_attn.q_conv1d.weight": ("F32", (12288, 1, 4)),
    "self_attn.k_proj.weight": ("BF16", (12288, 7168)), "self_attn.k_conv1d.weight": ("F32", (12288, 1, 4)),
    "self_attn.v_proj.weight": ("BF16", (12288, 7168)), "self_attn.v_conv1d.weight": ("F32", (12288, 1, 4)),
    "self_attn.f_a_proj.weight": ("BF16", (128, 7168)), "self_attn.f_b_proj.weight": ("BF16", (12288, 128)),
    "self_attn.A_log": ("F32", (128,)), "self_attn.dt_bias": ("F32", (12288,)),
    "self_attn.b_proj.weight": ("BF16", (96, 7168)), "self_attn.g_proj.weight": ("BF16", (12288, 7168)),
    "self_attn.o_norm.weight": ("F32", (128,)), "self_attn.o_proj.weight": ("BF16", (7168, 12288)),
    "mlp_res_norm.weight": ("BF16", (7168,)), "mlp_res_proj.weight": ("BF16", (1, 7168)),
    "post_attention_layernorm.weight": ("BF16", (7168,)),
    "block_sparse_moe.gate.weight": ("BF16", (896, 7168)),
    "block_sparse_moe.gate.e_score_correction_bias": ("F32", (896,)),
    "block_sparse_moe.routed_expert_down_proj.weight": ("BF16", (3584, 7168)),
    "block_sparse_moe.routed_expert_norm.weight": ("BF16", (3584,)),
    "block_sparse_moe.routed_expert_up_proj.weight": ("BF16", (7168, 3584)),
    "block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", (6144, 7168)),
    "block_sparse_moe.shared_experts.up_proj.weight": ("BF16", (6144, 7168)),
    "block_sparse_moe.shared_experts.down_proj.weight": ("BF16", (7168, 6144)),
}
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


def ours_to_released_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "conv":
        return (shape[0], 1, shape[1])
    if kind == "a_log":
        return (-(-shape[0] // A_LOG_MULTIPLE) * A_LOG_MULTIPLE,)
    return shape


def test_full_size_names_and_shapes_are_the_released_layout():
    cfg = load_config("configs/full.yaml")
    tensors = kimi_k3_tensors(cfg.model)
    by_name = {t.name: t for t in tensors}
    assert len(by_name) == len(tensors)
    layer_1 = {t.name[len(f"{PREFIX}layers.1."):]: t for t in tensors
               if t.name.startswith(f"{PREFIX}layers.1.") and ".experts." not in t.name}
    assert {name: (("F32" if t.dtype == torch.float32 else "BF16"), t.shape) for name, t in layer_1.items()} \
        == RELEASED_LAYER_1
    experts = [t for t in tensors if ".block_sparse_moe.experts." in t.name]
    assert len(experts) == 896 * 3 * 92  # w1, w2, w3 of every expert of the 92 MoE layers
    assert by_name[f"{PREFIX}layers.5.block_sparse_moe.experts.895.w1.weight"].shape == (3072, 3584)
    assert by_name[f"{PREFIX}layers.5.block_sparse_moe.experts.895.w2.weight"].shape == (3584, 3072)
    assert by_name[f"{PREFIX}layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)  # an MLA layer
    assert by_name[f"{PREFIX}layers.3.self_attn.q_b_proj.weight"].shape == (96 * 192, 1536)
    assert by_name[f"{PREFIX}layers.0.mlp.gate_proj.weight"].shape == (33792, 7168)  # the dense layer
    assert by_name[f"{PREFIX}embed_tokens.weight"].shape == by_name[LM_HEAD].shape == (163840, 7168)
    assert f"{PREFIX}output_attn_res_norm.weight" in by_name and f"{PREFIX}norm.weight" in by_name

    # Every released tensor is made from one of ours, shapes agreeing, and every one of ours is in the layout
    # (the vision tower and projector too: the release's 168 vision tensors, under its names).
    model, _ = meta_model(cfg)
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for t in tensors:
        shape = ours[t.ours][1:] if t.expert is not None else ours[t.ours]
        assert ours_to_released_shape(t.kind, shape) == t.shape, t.name
    assert set(ours) == {t.ours for t in tensors}
    vision = [t for t in tensors if t.name.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 168 and sum(math.prod(t.shape) for t in vision) == 401_214_464 + 46_144_512
    assert by_name["vision_tower.patch_embed.proj.weight"].shape == (1024, 3, 14, 14)
    assert by_name["vision_tower.patch_embed.pos_emb.weight"].shape == (64, 64, 1024)
    assert by_name["mm_projector.proj.2.weight"].shape == (7168, 4096)


def released_rounding(model: torch.nn.Module, cfg) -> None:
    """Our weights as the export stores them: bf16 where the release keeps bf16 (float32 stays exact)."""
    state = model.state_dict()
    with torch.no_grad():
        for t in kimi_k3_tensors(cfg.model):
            if t.dtype == torch.bfloat16:
                state[t.ours].copy_(state[t.ours].to(torch.bfloat16))


@pytest.mark.timeout(300)
def test_export_then_import_gives_identical_logits_and_files(tmp_path):
    cfg = tiny_config("train.steps=2", f"train.run_dir={tmp_path / 'run'}", "logging.progress=false")
    source = Trainer(cfg)
    source.run()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(cfg)))

    done = tool("export", tmp_path / "run" / "checkpoints", tmp_path / "hf", "--format", "kimi-k3-hf",
                "--max-shard-mb", 0.05)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    layout = kimi_k3_tensors(cfg.model)
    assert sorted(index) == sorted(t.name for t in layout) and len(set(index.values())) > 1
    for t in layout[:40] + layout[-40:]:
        with safe_open(str(tmp_path / "hf" / index[t.name]), framework="pt") as f:
            stored = f.get_tensor(t.name)
        assert tuple(stored.shape) == t.shape and stored.dtype == t.dtype, t.name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]["num_experts"] == 8

    done = tool("import", tmp_path / "hf", tmp_path / "imported", "--config", config_file)
    assert done.returncode == 0, done.stderr
    assert verify(tmp_path / "imported" / "step_00000000") == []

    resumed = Trainer(tiny_config(f"train.run_dir={tmp_path / 'again'}", "logging.progress=false",
                                  f"train.resume={tmp_path / 'imported' / 'step_00000000'}",
                                  f"checkpoint.dir={tmp_path / 'imported'}", "train.steps=3"))
    resumed.resume()
    optimizer = resumed.optimizer
    assert resumed.step == 0 and all(float(optimizer.moment(bucket, moment).abs().sum()) == 0
                                     for bucket in optimizer.buckets for moment in ("exp_avg", "exp_avg_sq"))
    released_rounding(source.model, cfg)
    batch = PretrainingData(cfg).next_batch(2)
    with torch.no_grad():
        want, _ = source.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
        got, _ = resumed.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
    assert torch.equal(got, want)  # the exported values, bit for bit

    # Export again from the imported checkpoint: the same files, byte for byte.
    export(tmp_path / "imported" / "step_00000000", tmp_path / "hf2", int(0.05 * 2**20), "kimi-k3-hf")
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        assert file.read_bytes() == (tmp_path / "hf2" / file.name).read_bytes(), file.name
    assert len(resumed.run()) == 3  # and it trains on from step 0 with a fresh optimizer
