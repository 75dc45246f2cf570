"""The released Kimi K3 checkpoint's config.json, both ways: our model section in the release's form (export), and
the release's file as our model section (import).

The release's file (public: moonshotai/Kimi-K3 config.json; NeMo AutoModel's kimi_k3 config.py and SGLang's
loader read the same keys): top level `architectures` ["KimiK3ForConditionalGeneration"], `model_type` "kimi_k3",
the special token ids, `text_config` (`model_type` "kimi_linear", the backbone, and the routed experts'
`quantization_config`: compressed-tensors MXFP4) and `vision_config` (MoonViT). Loaders fill a missing key with a
default that may build a different model, so the export writes every key that shapes the model.

Import maps every key it understands; a key whose value our model cannot represent stops the import naming the key
and the value; keys it does not know (and the Hugging Face generation defaults it need not) are listed in the note
of the import, never silently dropped.
"""

from typing import Any

from moe_pretrain.config import ConfigError, ModelConfig
from moe_pretrain.model.mixers import mixer_spec

ARCHITECTURE = "KimiK3ForConditionalGeneration"
MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
QUANTIZATION_FORMAT = "mxfp4-pack-quantized"
QUANTIZATION_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
"""The release's list: every Linear but the routed experts stays bf16 (the routers, latent projections and AttnRes
pseudo-queries are not Linear modules of its loaders' quantized kind)."""


def quantization_config() -> dict[str, Any]:
    """The release's text_config.quantization_config: routed experts in MXFP4, groups of 32, E8M0 scales."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    return {"config_groups": {"group_0": {"format": QUANTIZATION_FORMAT, "input_activations": None,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": QUANTIZATION_FORMAT, "global_compression_ratio": None, "ignore": list(QUANTIZATION_IGNORE),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def _layer_lists(m: ModelConfig) -> tuple[list[int], list[int]]:
    """(KDA layers, full-attention layers), 1-based as the release lists them (each mixer's spec names its
    list: release_layers)."""
    lists: dict[str | None, list[int]] = {"kda_layers": [], "full_attn_layers": []}
    for i in range(m.num_layers):
        spec = mixer_spec(m, i)
        if spec.release_layers not in lists:
            raise ConfigError(f"model.layer_pattern: layer {i} is a {spec.kind} layer, which the release's config "
                              "cannot name")
        lists[spec.release_layers].append(i + 1)
    return lists["kda_layers"], lists["full_attn_layers"]


def text_config(m: ModelConfig, quantized: bool) -> dict[str, Any]:
    """config.json's text_config for our model section (with the experts' quantization_config when quantized)."""
    if m.moe.num_shared_experts and m.moe.shared_intermediate != m.moe.expert_intermediate:
        raise ConfigError(f"model.moe.shared_intermediate={m.moe.shared_intermediate}: the release's config gives "
                          f"shared experts the routed experts' width (moe_intermediate_size="
                          f"{m.moe.expert_intermediate}); it cannot describe another")
    kda, mla = _layer_lists(m)
    text = {
        "model_type": TEXT_MODEL_TYPE, "architectures": ["KimiLinearForCausalLM"], "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "rms_norm_eps": m.norm_eps,
        "initializer_range": m.init_std, "tie_word_embeddings": False, "hidden_act": "situ",
        "activation_situ_beta": m.moe.situ_beta, "activation_situ_linear_beta": m.moe.situ_linear_beta,
        "first_k_dense_replace": m.dense_layers, "moe_layer_freq": 1, "intermediate_size": m.dense_intermediate,
        "num_attention_heads": m.mla.num_heads, "num_key_value_heads": m.mla.num_heads,
        "q_lora_rank": m.mla.q_lora_rank, "kv_lora_rank": m.mla.kv_lora_rank,
        "qk_nope_head_dim": m.mla.qk_nope_head_dim, "qk_rope_head_dim": m.mla.qk_rope_head_dim,
        "v_head_dim": m.mla.v_head_dim, "mla_use_nope": m.mla.position == "nope", "mla_use_output_gate": True,
        "num_experts": m.moe.num_experts, "num_experts_per_token": m.moe.top_k,
        "moe_intermediate_size": m.moe.expert_intermediate, "num_shared_experts": m.moe.num_shared_experts,
        "routed_expert_hidden_size": m.moe.latent_size, "latent_moe_use_norm": True,
        "routed_scaling_factor": m.moe.routed_scaling, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "attn_res_block_size": m.attn_res.block_size,
        "max_position_embeddings": 1048576,
        "linear_attn_config": {"num_heads": m.kda.num_heads, "head_dim": m.kda.head_dim,
                               "short_conv_kernel_size": m.kda.conv_size, "use_full_rank_gate": True,
                               "gate_lower_bound": m.kda.lower_bound, "kda_layers": kda, "full_attn_layers": mla},
    }
    if m.kda.gate != "lower_bound":
        raise ConfigError(f"model.kda.gate={m.kda.gate!r}: the release's KDA gate is the lower-bound form; its "
                          "config cannot describe another")
    if quantized:
        text["quantization_config"] = quantization_config()
    return text


def vision_config(m: ModelConfig) -> dict[str, Any]:
    v, e = m.vision, m.vision.encoder
    return {"patch_size": v.patch_size, "init_pos_emb_height": e.pos_grid, "init_pos_emb_width": e.pos_grid,
            "init_pos_emb_time": e.max_frames, "pos_emb_type": "divided_fixed",
            "pos_emb_interpolation_mode": e.pos_interpolation, "vt_num_attention_heads": e.num_heads,
            "vt_num_hidden_layers": e.num_layers, "vt_hidden_size": e.hidden_size,
            "vt_intermediate_size": e.intermediate_size, "qkv_hidden_size": e.num_heads * e.head_dim,
            "merge_kernel_size": [e.merge, e.merge], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
            "mm_hidden_size": e.hidden_size, "projector_hidden_act": "gelu", "projector_ln_eps": m.norm_eps,
            "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
            "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": m.hidden_size}


def release_config(m: ModelConfig, quantized: bool, tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """The whole config.json. tokens: bos / eos / pad / media_placeholder ids of the vocabulary the model was
    trained in (omitted when unknown)."""
    config: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": "bfloat16",
                              "ignore_index": -100, "tie_word_embeddings": False}
    for name, value in (tokens or {}).items():
        config[f"{name}_token_id"] = value
    config["text_config"] = text_config(m, quantized)
    config["vision_config"] = vision_config(m)
    return config


# Keys of the release's text_config that must hold exactly these values: our model has no other form of them.
_TEXT_FIXED = {"model_type": TEXT_MODEL_TYPE, "hidden_act": "situ", "tie_word_embeddings": False, "moe_layer_freq": 1,
               "mla_use_output_gate": True, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
               "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc"}
_WHY_FIXED = {"num_nextn_predict_layers": "multi-token-prediction layers (ours, model.mtp, have no place in the "
                                          "released layout: an export keeps them in its extras file)"}
# text_config key -> our model key (dotted under model.).
_TEXT_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
              "rms_norm_eps": "norm_eps", "initializer_range": "init_std", "first_k_dense_replace": "dense_layers",
              "intermediate_size": "dense_intermediate", "activation_situ_beta": "moe.situ_beta",
              "activation_situ_linear_beta": "moe.situ_linear_beta", "num_attention_heads": "mla.num_heads",
              "q_lora_rank": "mla.q_lora_rank", "kv_lora_rank": "mla.kv_lora_rank",
              "qk_nope_head_dim": "mla.qk_nope_head_dim", "qk_rope_head_dim": "mla.qk_rope_head_dim",
              "v_head_dim": "mla.v_head_dim", "rope_theta": "mla.rope_theta", "num_experts": "moe.num_experts",
              "num_experts_per_token": "moe.top_k", "moe_intermediate_size": "moe.expert_intermediate",
              "num_shared_experts": "moe.num_shared_experts", "routed_expert_hidden_size": "moe.latent_size",
              "routed_scaling_factor": "moe.routed_scaling", "attn_res_block_size": "attn_res.block_size"}
_KDA_KEYS = {"num_heads": "kda.num_heads", "head_dim": "kda.head_dim", "short_conv_kernel_size": "kda.conv_size",
             "gate_lower_bound": "kda.lower_bound"}
_VISION_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
                 "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
                 "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "projector_hidden_act": "gelu"}
_VISION_KEYS = {"patch_size": "vision.patch_size", "init_pos_emb_height": "vision.encoder.pos_grid",
                "init_pos_emb_time": "vision.encoder.max_frames",
                "pos_emb_interpolation_mode": "vision.encoder.pos_interpolation",
                "vt_num_attention_heads": "vision.encoder.num_heads",
                "vt_num_hidden_layers": "vision.encoder.num_layers",
                "vt_hidden_size": "vision.encoder.hidden_size",
                "vt_intermediate_size": "vision.encoder.intermediate_size"}
_TOP_FIXED = {"model_type": MODEL_TYPE, "tie_word_embeddings": False}
_TOP_NOTED = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id", "image_placeholder")
RELEASE_TOKENS = {"bos": "bos", "eos": "eos", "pad": "pad", "image_patch": "media_placeholder"}
"""Our special tokens (data/vocabulary.py) -> the release's <name>_token_id keys: the model puts an image's patch
features where image_patch stands, which the release calls its media placeholder."""


def release_token_ids(special_ids: dict[str, int]) -> dict[str, int]:
    """The release's token ids (name without _token_id) from a checkpoint's special ids."""
    return {RELEASE_TOKENS[name]: value for name, value in special_ids.items() if name in RELEASE_TOKENS}


def special_ids_of_release(config: dict[str, Any]) -> dict[str, int]:
    """Our special ids from a release config.json's top-level <name>_token_id keys (those it has)."""
    return {ours: config[f"{theirs}_token_id"] for ours, theirs in RELEASE_TOKENS.items()
            if isinstance(config.get(f"{theirs}_token_id"), int)}


def _refuse(where: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {where}={value!r}: {why}; our model cannot represent it")


def _fixed(section: dict, fixed: dict, where: str, used: set[str]) -> None:
    for key, expected in fixed.items():
        if key in section:
            used.add(key)
            if section[key] != expected:
                raise _refuse(f"{where}.{key}", section[key], f"the model has only {expected!r}")


def _check_quantization(found: dict) -> None:
    """The experts' quantization must be the release's MXFP4 scheme (what import decodes)."""
    expected = quantization_config()
    group = next(iter(found.get("config_groups", {}).values()), {})
    weights = group.get("weights", {})
    for key in ("num_bits", "type", "group_size", "strategy", "symmetric", "scale_dtype"):
        if weights.get(key) != expected["config_groups"]["group_0"]["weights"][key]:
            raise _refuse(f"text_config.quantization_config...weights.{key}", weights.get(key),
                          f"import decodes {QUANTIZATION_FORMAT} only")
    for key in ("format", "quant_method"):
        if found.get(key) != expected[key]:
            raise _refuse(f"text_config.quantization_config.{key}", found.get(key),
                          f"import decodes {QUANTIZATION_FORMAT} only")


def model_section(config: dict[str, Any]) -> tuple[dict[str, Any], bool, list[str]]:
    """The release's config.json -> (our model keys, dotted under model., and their values; whether the experts are
    MXFP4; notes: what was read but not mapped). A value our model cannot represent raises ConfigError naming it."""
    if ARCHITECTURE not in config.get("architectures", [ARCHITECTURE]):
        raise _refuse("architectures", config["architectures"], f"import reads {ARCHITECTURE} checkpoints")
    used: set[str] = {"architectures", "text_config", "vision_config"}
    _fixed(config, _TOP_FIXED, "config", used)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: no text_config (is this a Kimi K3 checkpoint directory?)")
    text_used: set[str] = set()
    _fixed(text, _TEXT_FIXED, "text_config", text_used)
    values = {ours: text[key] for key, ours in _TEXT_KEYS.items() if key in text}
    text_used |= set(_TEXT_KEYS) & set(text)
    for key, why in _WHY_FIXED.items():
        text_used.add(key)
        if text.get(key, 0):
            raise _refuse(f"text_config.{key}", text[key], why)
    heads = text.get("num_attention_heads")
    text_used |= {"num_key_value_heads", "mla_use_nope", "use_grouped_topk", "rope_parameters"}
    if text.get("num_key_value_heads", heads) != heads:
        raise _refuse("text_config.num_key_value_heads", text["num_key_value_heads"],
                      f"MLA has one key / value head per query head ({heads})")
    values["mla.position"] = "nope" if text.get("mla_use_nope", True) else "rope"
    if "moe_intermediate_size" in text:  # the release's shared experts are routed-expert-wide
        values["moe.shared_intermediate"] = text["moe_intermediate_size"]
    linear = text.get("linear_attn_config") or {}
    text_used.add("linear_attn_config")
    if not linear.get("use_full_rank_gate", True):
        raise _refuse("text_config.linear_attn_config.use_full_rank_gate", False, "KDA's gate is full rank only")
    values.update({ours: linear[key] for key, ours in _KDA_KEYS.items() if key in linear})
    layers = text.get("num_hidden_layers", 0)
    kda, full = set(linear.get("kda_layers", [])), set(linear.get("full_attn_layers", []))
    if kda & full or kda | full != set(range(1, layers + 1)):
        raise _refuse("text_config.linear_attn_config.kda_layers / full_attn_layers", sorted(kda & full) or
                      sorted(set(range(1, layers + 1)) ^ (kda | full)), f"they must split layers 1..{layers}")
    values["layer_pattern"] = "".join("K" if i + 1 in kda else "M" for i in range(layers))
    quantized = "quantization_config" in text
    if quantized:
        text_used.add("quantization_config")
        _check_quantization(text["quantization_config"])
    vision = config.get("vision_config") or {}
    vision_values, vision_used = _vision_values(vision, text.get("hidden_size"), text.get("rms_norm_eps"))
    values.update(vision_values)
    notes = [f"{key}={config[key]!r}" for key in _TOP_NOTED if key in config]
    unread = (sorted(set(config) - used - set(_TOP_NOTED)) + [f"text_config.{k}" for k in sorted(set(text) - text_used)]
              + [f"vision_config.{k}" for k in sorted(set(vision) - vision_used)])
    if unread:
        notes.append("not used (serving and generation settings, or unknown): " + ", ".join(unread))
    return {f"model.{key}": value for key, value in values.items()}, quantized, notes


def _vision_values(vision: dict[str, Any], hidden: int | None, eps: float | None
                   ) -> tuple[dict[str, Any], set[str]]:
    """(our vision keys and values, the vision_config keys read)."""
    used = {"init_pos_emb_width", "merge_kernel_size", "qkv_hidden_size", "mm_hidden_size", "text_hidden_size",
            "projector_ln_eps", *_VISION_KEYS}
    _fixed(vision, _VISION_FIXED, "vision_config", used)
    values = {ours: vision[key] for key, ours in _VISION_KEYS.items() if key in vision}
    if vision.get("init_pos_emb_width", vision.get("init_pos_emb_height")) != vision.get("init_pos_emb_height"):
        raise _refuse("vision_config.init_pos_emb_width", vision["init_pos_emb_width"],
                      "the position table is square (init_pos_emb_height)")
    merge = vision.get("merge_kernel_size", [2, 2])
    if len(merge) != 2 or merge[0] != merge[1]:
        raise _refuse("vision_config.merge_kernel_size", merge, "the merge is square")
    values["vision.encoder.merge"] = merge[0]
    if "qkv_hidden_size" in vision:
        heads = vision.get("vt_num_attention_heads", 12)
        if vision["qkv_hidden_size"] % heads:
            raise _refuse("vision_config.qkv_hidden_size", vision["qkv_hidden_size"],
                          f"it must split into vt_num_attention_heads={heads} heads")
        values["vision.encoder.head_dim"] = vision["qkv_hidden_size"] // heads
    for key, expected, why in (("mm_hidden_size", vision.get("vt_hidden_size"), "the projector reads the tower"),
                               ("text_hidden_size", hidden, "the projector writes the text width"),
                               ("projector_ln_eps", eps, "the projector's norm shares the model's rms_norm_eps")):
        if key in vision and vision[key] != expected:
            raise _refuse(f"vision_config.{key}", vision[key], f"{why} ({expected!r})")
    return values, used
