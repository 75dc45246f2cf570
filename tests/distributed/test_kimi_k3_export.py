"""Export to the released Kimi K3 layout and import back: names, shapes, dtypes and files at full size (meta
tensors: the release's 497,220 tensors in 96 files), a release-format fixture's byte-exact round trip through
import and export, and a trained checkpoint's round trip (identical logits, identical files)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from launch.local import free_port
from moe_pretrain.checkpoint import mxfp4, verify
from moe_pretrain.checkpoint.export import export
from moe_pretrain.checkpoint.kimi_k3 import (
    A_LOG_MULTIPLE,
    LM_HEAD,
    PREFIX,
    kimi_k3_tensors,
    release_file_name,
    release_files,
)
from moe_pretrain.checkpoint.kimi_k3_config import release_config
from moe_pretrain.config import load_config
from moe_pretrain.data import PretrainingData
from moe_pretrain.data.patches import placed_images
from moe_pretrain.model.meta import meta_model
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.checkpoints_cli import config_file_of, tool
from tests.models import MXFP4_TINY, tiny_config

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
    if kind == "mxfp4_packed":
        return (shape[0], shape[1] // 2)
    if kind == "mxfp4_scale":
        return (shape[0], shape[1] // 32)
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
    assert len(experts) == 896 * 3 * 2 * 92  # w1, w2, w3 of every expert of the 92 MoE layers, codes and scales
    assert len(tensors) == 497_220  # the release's index
    # Layer 0's attention mix never gets a gradient, but the release stores it: the count above includes it.
    assert {f"{PREFIX}layers.0.self_attention_res_norm.weight", f"{PREFIX}layers.0.self_attention_res_proj.weight"} \
        <= set(by_name)
    expert = f"{PREFIX}layers.5.block_sparse_moe.experts.895"
    assert {name: (by_name[f"{expert}.{name}"].shape, by_name[f"{expert}.{name}"].dtype) for name in (
        "w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale", "w3.weight_packed",
        "w3.weight_scale")} == {  # the published table
        "w1.weight_packed": ((3072, 1792), torch.uint8), "w1.weight_scale": ((3072, 112), torch.uint8),
        "w2.weight_packed": ((3584, 1536), torch.uint8), "w2.weight_scale": ((3584, 96), torch.uint8),
        "w3.weight_packed": ((3072, 1792), torch.uint8), "w3.weight_scale": ((3072, 112), torch.uint8)}
    unquantized = {t.name: t for t in kimi_k3_tensors(cfg.model, "bf16")}
    assert unquantized[f"{expert}.w2.weight"].shape == (3584, 3072) and len(unquantized) == 497_220 - 896 * 3 * 92
    # The release's 96 files: one per layer (layer 0's dense MLP in the first), then the embeddings, final mix,
    # norm and head, then the projector, then the tower.
    files = release_files(tensors)
    assert len(files) == 96 and release_file_name(94, 96) == "model-00094-of-000096.safetensors"
    assert {t.name for t in files[0]} >= {f"{PREFIX}layers.0.mlp.down_proj.weight"}
    assert all(t.name.startswith(f"{PREFIX}layers.{i}.") for i in range(93) for t in files[i])
    assert {t.name for t in files[93]} == {LM_HEAD, *(f"{PREFIX}{name}.weight" for name in (
        "embed_tokens", "norm", "output_attn_res_norm", "output_attn_res_proj"))}
    assert {t.name.split(".")[0] for t in files[94]} == {"mm_projector"}
    assert {t.name.split(".")[0] for t in files[95]} == {"vision_tower"}
    assert by_name[f"{PREFIX}layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)  # an MLA layer
    assert by_name[f"{PREFIX}layers.3.self_attn.q_b_proj.weight"].shape == (96 * 192, 1536)
    assert by_name[f"{PREFIX}layers.0.mlp.gate_proj.weight"].shape == (33792, 7168)  # the dense layer
    assert by_name[f"{PREFIX}embed_tokens.weight"].shape == by_name[LM_HEAD].shape == (163840, 7168)
    assert f"{PREFIX}output_attn_res_norm.weight" in by_name and f"{PREFIX}norm.weight" in by_name

    # Every released tensor is made from one of ours, shapes agreeing, and every one of ours is in the layout
    # (the vision tower and projector too: the release's 168 vision tensors, under its names), but for the
    # multi-token-prediction block, which the release does not carry (num_nextn_predict_layers 0).
    model = meta_model(cfg.model)
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for t in tensors:
        shape = ours[t.ours][1:] if t.expert is not None else ours[t.ours]
        assert ours_to_released_shape(t.kind, shape) == t.shape, t.name
    assert {name for name in ours if not name.startswith("mtp.")} == {t.ours for t in tensors}
    vision = [t for t in tensors if t.name.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 168 and sum(math.prod(t.shape) for t in vision) == 401_214_464 + 46_144_512
    assert by_name["vision_tower.patch_embed.proj.weight"].shape == (1024, 3, 14, 14)
    assert by_name["vision_tower.patch_embed.pos_emb.weight"].shape == (64, 64, 1024)
    assert by_name["mm_projector.proj.2.weight"].shape == (7168, 4096)


def released_rounding(model: torch.nn.Module, cfg) -> None:
    """Our weights as the export stores them: bf16 where the release keeps bf16 (float32 stays exact), routed
    experts through MXFP4."""
    state = model.state_dict()
    with torch.no_grad():
        for t in kimi_k3_tensors(cfg.model):
            if t.kind == "mxfp4_packed":
                state[t.ours][t.expert] = mxfp4.decode(*mxfp4.encode(state[t.ours][t.expert]))
            elif t.dtype == torch.bfloat16:
                state[t.ours].copy_(state[t.ours].to(torch.bfloat16))


@pytest.mark.timeout(300)
def test_export_then_import_gives_identical_logits_and_files(tmp_path):
    cfg = tiny_config(*MXFP4_TINY, "train.steps=2", f"train.run_dir={tmp_path / 'run'}", "logging.progress=false")
    source = Trainer(cfg)
    run_training(source)
    config_file = config_file_of(cfg, tmp_path)

    done = tool("export", tmp_path / "run" / "checkpoints", tmp_path / "hf", "--format", "kimi-k3-hf")
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    layout = kimi_k3_tensors(cfg.model)
    assert sorted(index) == sorted(t.name for t in layout)
    assert sorted(set(index.values())) == [release_file_name(i, 9) for i in range(1, 10)]  # 6 layers + 3
    for t in layout:
        with safe_open(str(tmp_path / "hf" / index[t.name]), framework="pt") as f:
            stored = f.get_tensor(t.name)
        assert tuple(stored.shape) == t.shape and stored.dtype == t.dtype, t.name
    release = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert release["architectures"] == ["KimiK3ForConditionalGeneration"] and release["model_type"] == "kimi_k3"
    assert release["text_config"]["num_experts"] == 8
    assert release["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    # The model's own token ids (a loader would otherwise take the release's 163605, outside this vocabulary).
    vocabulary = source.data.vocabulary
    assert {k: v for k, v in release.items() if k.endswith("_token_id")} == {
        "bos_token_id": vocabulary.bos, "eos_token_id": vocabulary.eos, "pad_token_id": vocabulary.pad,
        "media_placeholder_token_id": vocabulary.image_patch}
    assert release["media_placeholder_token_id"] < cfg.model.vocab_size

    done = tool("import", tmp_path / "hf", tmp_path / "imported", "--config", config_file)
    assert done.returncode == 0, done.stderr
    assert "GB/s" in done.stdout and "TB release would take" in done.stdout
    assert verify(tmp_path / "imported" / "step_00000000") == []

    resumed = Trainer(tiny_config(*MXFP4_TINY, f"train.run_dir={tmp_path / 'again'}", "logging.progress=false",
                                  f"train.resume={tmp_path / 'imported' / 'step_00000000'}",
                                  f"checkpoint.dir={tmp_path / 'imported'}", "train.steps=3"))
    resumed.checkpoints.resume()
    optimizer = resumed.optimizer
    assert resumed.step == 0 and all(float(moment.abs().sum()) == 0
                                     for bucket in optimizer.buckets for moment in optimizer.moments(bucket).values())
    released_rounding(source.model, cfg)
    batch = PretrainingData(cfg).next_batch(2)
    with torch.no_grad():
        want, _ = source.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
        got, _ = resumed.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
    assert torch.equal(got, want)  # the exported values, bit for bit

    # Export again from the imported checkpoint (two processes writing the files): the same files, byte for byte.
    export(tmp_path / "imported" / "step_00000000", tmp_path / "hf2", layout="kimi-k3-hf", workers=2)
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        assert file.read_bytes() == (tmp_path / "hf2" / file.name).read_bytes(), file.name
    assert len(run_training(resumed)) == 3  # and it trains on from step 0 with a fresh optimizer


RELEASE_CONFIG = json.loads((Path(__file__).parents[1] / "assets" / "kimi_k3_release_config.json").read_text())


def write_release_fixture(directory: Path, cfg) -> dict[str, torch.Tensor]:
    """A small checkpoint as the release stores one: the published config.json with this model's sizes (every
    other key of the release kept), random bf16 / fp32 tensors, MXFP4 experts with random codes (negative zeros
    included) and scales, every group holding a code of magnitude 6 as the format's rule writes it, A_log
    zero-padded; spread over four files of the release's naming. Returns the tensors by name."""
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for t in kimi_k3_tensors(cfg.model):
        if t.kind == "mxfp4_packed":
            codes = torch.randint(0, 256, t.shape, generator=generator, dtype=torch.uint8)
            codes[:, ::16] = (codes[:, ::16] & 0xF0) | 0x07  # one 6.0 in every group of 32 values
            tensors[t.name] = codes
        elif t.kind == "mxfp4_scale":
            tensors[t.name] = torch.randint(118, 127, t.shape, generator=generator, dtype=torch.uint8)
        else:
            values = torch.randn(t.shape, generator=generator) * 0.05
            if t.kind == "a_log":
                values[cfg.model.kda.num_heads:] = 0.0
            tensors[t.name] = values.to(t.dtype)
    config = json.loads(json.dumps(RELEASE_CONFIG))
    ours = release_config(cfg.model, quantized=True)
    for section in ("text_config", "vision_config"):
        config[section].update(ours[section])
    (directory / "config.json").write_text(json.dumps(config))
    names, weight_map = sorted(tensors), {}
    for k in range(4):
        file = release_file_name(k + 1, 4)
        save_file({name: tensors[name] for name in names[k::4]}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in names[k::4]})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def release_fixture(tmp_path: Path) -> tuple:
    """(the tiny MXFP4 config, the fixture's tensors in tmp_path/release, the config as a file)."""
    cfg = tiny_config(*MXFP4_TINY)
    (tmp_path / "release").mkdir()
    return cfg, write_release_fixture(tmp_path / "release", cfg), config_file_of(cfg, tmp_path)


def directly_loaded(cfg, tensors: dict[str, torch.Tensor], run_dir: Path) -> torch.nn.Module:
    """A model given the fixture's values straight from its tensors (MXFP4 decoded in float64, then cast), with
    no checkpoint in between."""
    model = Trainer(tiny_config(*MXFP4_TINY, f"train.run_dir={run_dir}", "logging.progress=false")).model
    state = model.state_dict()
    with torch.no_grad():
        for t in kimi_k3_tensors(cfg.model):
            target = state[t.ours] if t.expert is None else state[t.ours][t.expert]
            if t.kind == "mxfp4_packed":
                scale = tensors[t.name.replace("weight_packed", "weight_scale")]
                target.copy_(mxfp4.decode(tensors[t.name], scale, torch.float64))
            elif t.kind != "mxfp4_scale":
                target.copy_(t.from_hf(tensors[t.name], cfg.model.kda.num_heads, torch.float64))
    return model


def assert_exports_back(imported: Path, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """The import, exported to the release's layout, holds exactly the fixture's tensors, byte for byte; both
    worker processes wrote a share of it."""
    assert {p.name.split("_")[2] for p in imported.glob("__*.distcp")} == {"0", "1"}
    export(imported, out, layout="kimi-k3-hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(tensors)
    for name, want in tensors.items():
        with safe_open(str(out / index[name]), framework="pt") as f:
            got = f.get_tensor(name)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_release_checkpoint_imports_and_exports_back_byte_for_byte(tmp_path):
    cfg, tensors, config_file = release_fixture(tmp_path)

    # Two worker processes, each converting its share (the other tests import in one).
    done = tool("import", tmp_path / "release", tmp_path / "imported", "--config", config_file, "--workers", 2)
    assert done.returncode == 0, done.stderr
    assert "note: media_placeholder_token_id=163605" in done.stdout  # read, not mapped: said
    assert "text_config.max_position_embeddings" in done.stdout and "MXFP4 groups" not in done.stdout
    imported = tmp_path / "imported" / "step_00000000"
    assert_exports_back(imported, tensors, tmp_path / "exported")
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert {key: exported[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id",
                                           "media_placeholder_token_id")} == {
        key: RELEASE_CONFIG[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id",
                                             "media_placeholder_token_id")}  # the release's ids carried through

    resumed = Trainer(tiny_config(*MXFP4_TINY, f"train.run_dir={tmp_path / 'run'}", "logging.progress=false",
                                  f"train.resume={imported}", f"checkpoint.dir={tmp_path / 'imported'}"))
    resumed.checkpoints.resume()
    direct = directly_loaded(cfg, tensors, tmp_path / "direct")
    batch = PretrainingData(cfg).next_batch(2)
    with torch.no_grad():
        want, _ = direct(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                         placed_images(batch.grids, batch.starts))
        got, _ = resumed.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                               placed_images(batch.grids, batch.starts))
    assert torch.equal(got, want)


def test_bf16_experts_export_and_import_the_unquantized_variant(tmp_path):
    cfg = tiny_config(*MXFP4_TINY, "train.steps=1", f"train.run_dir={tmp_path / 'run'}", "logging.progress=false")
    source = Trainer(cfg)
    run_training(source)
    export(tmp_path / "run" / "checkpoints" / "step_00000001", tmp_path / "hf", layout="kimi-k3-hf", experts="bf16")
    release = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in release["text_config"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"{PREFIX}layers.1.block_sparse_moe.experts.7.w2.weight" in index
    assert not any(name.endswith("weight_packed") for name in index)
    config_file = config_file_of(cfg, tmp_path)
    done = tool("import", tmp_path / "hf", tmp_path / "imported", "--config", config_file)
    assert done.returncode == 0, done.stderr
    export(tmp_path / "imported" / "step_00000000", tmp_path / "hf2", layout="kimi-k3-hf", experts="bf16")
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        assert file.read_bytes() == (tmp_path / "hf2" / file.name).read_bytes(), file.name


def test_import_refuses_what_the_model_cannot_represent(tmp_path):
    release_fixture(tmp_path)
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    done = tool("import", tmp_path / "release", tmp_path / "imported")
    assert done.returncode == 2 and "text_config.num_nextn_predict_layers=1" in done.stderr, done.stderr
    assert not (tmp_path / "imported").exists()


@pytest.mark.timeout(300)
def test_continued_pretraining_imports_the_release_and_trains_a_new_stage(tmp_path):
    """docs/checkpoints.md's import workflow at tiny size: import the release, then train a longer-context stage
    from it (the model-only checkpoint starts the new schedule at its first stage, with a fresh optimizer)."""
    _, _, config_file = release_fixture(tmp_path)
    assert tool("import", tmp_path / "release", tmp_path / "ckpt", "--config", config_file).returncode == 0
    stage = ("stages=[{name: long, tokens: 1536, seq_len: 192, batch_tokens: 768, lr_peak: 0.001, lr_end: 0.0001, "
             "warmup_tokens: 768}]")
    trainer = Trainer(tiny_config(*MXFP4_TINY, stage, "train.steps=2", "logging.progress=false",
                                  f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                  f"train.resume={tmp_path / 'ckpt' / 'step_00000000'}"))
    history = run_training(trainer)
    assert [(h["step"], h["stage"], h["seq_len"]) for h in history] == [(1, "long", 192), (2, "long", 192)]
    assert all(math.isfinite(h["loss"]) for h in history)
    assert (tmp_path / "ckpt" / "step_00000002").is_dir()  # it saves on beside the import


@pytest.mark.timeout(300)
def test_import_under_torchrun_shares_the_work_between_its_ranks(tmp_path):
    _, tensors, config_file = release_fixture(tmp_path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           f"--master-port={free_port()}", "-m", "checkpoints_tool", "import",
                           str(tmp_path / "release"), str(tmp_path / "imported"), "--config", str(config_file)],
                          capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 reports
    assert_exports_back(tmp_path / "imported" / "step_00000000", tensors, tmp_path / "exported")


@pytest.mark.timeout(300)
def test_a_failing_worker_fails_the_import_and_commits_nothing(tmp_path):
    _, _, config_file = release_fixture(tmp_path)
    (tmp_path / "release" / release_file_name(3, 4)).write_bytes(b"not a safetensors file")
    done = tool("import", tmp_path / "release", tmp_path / "imported", "--config", config_file, "--workers", 2)
    assert done.returncode == 2 and "of 2 failed (their errors are printed above)" in done.stderr, done.stderr
    assert not (tmp_path / "imported" / "step_00000000").exists()
