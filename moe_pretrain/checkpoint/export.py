"""Model weights out of a checkpoint, consolidated, as sharded safetensors loadable without this package.

Works from the DCP metadata alone (global shapes and dtypes), in one process: no model is built.
Writes model-0000i-of-0000n.safetensors (each at most max_shard_bytes, tensors whole),
model.safetensors.index.json (weight_map, as the Hugging Face convention) and config.json, whose
field names follow MODEL.md. It streams: the files are planned from the metadata, and each is read
(only its tensors) and written before the next, so memory peaks at one file (or one tensor larger
than max_shard_bytes), never the model.
"""

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_pretrain.checkpoint.store import read_trainer_state

PREFIX = "model."


def model_tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Global shape and dtype of every model tensor of a checkpoint, keyed with the prefix."""
    metadata = FileSystemReader(path).read_metadata()
    return {key: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)}


def read_tensors(path: Path, metadata: dict[str, TensorStorageMetadata], keys: list[str]) -> dict[str, torch.Tensor]:
    """The named model tensors (metadata: model_tensor_metadata's), whole (consolidated from every rank's
    shards), keyed without the prefix."""
    tensors = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype) for key in keys}
    dcp.load(tensors, storage_reader=FileSystemReader(path), no_dist=True)
    return {key[len(PREFIX):]: tensor for key, tensor in tensors.items()}


def model_card(config: dict[str, Any]) -> dict[str, Any]:
    """Our resolved config's model section, under MODEL.md's names."""
    m = config["model"]
    return {
        "architecture": "hybrid KDA + gated MLA, AttnRes, Stable LatentMoE (moe-pretrain)",
        "vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "num_layers": m["num_layers"],
        "layer_types": ["kda" if c == "K" else "mla" for c in m["layer_pattern"]],
        "dense_layers": m["dense_layers"], "dense_intermediate_size": m["dense_intermediate"],
        "rms_norm_eps": m["norm_eps"], "tie_word_embeddings": False,
        "kda": {"num_heads": m["kda"]["num_heads"], "head_dim": m["kda"]["head_dim"],
                "short_conv_kernel": m["kda"]["conv_size"], "gate": m["kda"]["gate"],
                "gate_lower_bound": m["kda"]["lower_bound"], "chunk_size": m["kda"]["chunk_size"]},
        "mla": dict(m["mla"]),
        "moe": {"num_routed_experts": m["moe"]["num_experts"], "num_experts_per_token": m["moe"]["top_k"],
                "expert_intermediate_size": m["moe"]["expert_intermediate"],
                "latent_size": m["moe"]["latent_size"], "num_shared_experts": m["moe"]["num_shared_experts"],
                "shared_expert_intermediate_size": m["moe"]["shared_intermediate"],
                "routed_scaling_factor": m["moe"]["routed_scaling"], "balancing": m["moe"]["balancing"],
                "situ_beta": m["moe"]["situ_beta"], "situ_linear_beta": m["moe"]["situ_linear_beta"],
                "router": "sigmoid, top-k by score + expert_bias, weights renormalised"},
        "attn_res": {"block_size": m["attn_res"]["block_size"]},
        "vision": {"patch_size": m["vision"]["patch_size"], "channels": m["vision"]["channels"]},
    }


def _nbytes(meta: TensorStorageMetadata) -> int:
    return math.prod(meta.size) * meta.properties.dtype.itemsize


def export(path: Path, out: Path, max_shard_bytes: int = 1 << 30) -> list[Path]:
    metadata = model_tensor_metadata(path)
    config = read_trainer_state(path)["config"]
    plan: list[list[str]] = [[]]
    size = 0
    for key in sorted(metadata):
        nbytes = _nbytes(metadata[key])
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(key)
        size += nbytes
    out.mkdir(parents=True, exist_ok=False)
    files, weight_map = [], {}
    for i, keys in enumerate(plan, start=1):
        file = out / f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        shard = read_tensors(path, metadata, keys)
        save_file(shard, str(file), metadata={"format": "pt"})
        del shard
        files.append(file)
        weight_map.update({key[len(PREFIX):]: file.name for key in keys})
    total = sum(_nbytes(meta) for meta in metadata.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    (out / "config.json").write_text(json.dumps(model_card(config), indent=1))
    return files
