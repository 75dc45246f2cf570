"""Model weights out of a checkpoint, consolidated, as sharded safetensors loadable without this package.

Works from the DCP metadata alone (global shapes and dtypes), in one process: no model is built.
Writes model-0000i-of-0000n.safetensors (each at most max_shard_bytes, tensors whole),
model.safetensors.index.json (weight_map, as the Hugging Face convention) and config.json. Two layouts:
native (our names and dtypes, config.json under docs/model.md's names, files of at most max_shard_bytes) and
kimi-k3-hf (the released Kimi K3 checkpoint as published, kimi_k3.py: its names, dtypes, MXFP4 routed experts
(or bf16 ones, experts="bf16"), its files (one per layer, then the rest) and its config.json
(kimi_k3_config.py); our resolved config goes beside it in moe_pretrain.json, and what our model has that the
layout has not to moe_pretrain_extras.safetensors). It streams: the files are planned from the metadata, and each
is read (only its tensors, and of a stacked expert weight only the experts it holds) and written before the next,
so memory peaks at one file, never the model.
"""

import json
import math
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_pretrain.checkpoint.kimi_k3 import kimi_k3_tensors, release_file_name, release_files, to_release
from moe_pretrain.checkpoint.kimi_k3_config import release_config, release_token_ids
from moe_pretrain.checkpoint.store import read_trainer_state
from moe_pretrain.config import ModelConfig
from moe_pretrain.config.loader import build
from moe_pretrain.config.model import MIXER_LETTERS
from parallel.flat_shards import BoxedLoadPlanner, BoxedTensor

PREFIX = "model."
LAYOUTS = ("native", "kimi-k3-hf")
EXTRAS = "moe_pretrain_extras.safetensors"
RUN_CONFIG = "moe_pretrain.json"


def model_tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Global shape and dtype of every model tensor of a checkpoint, keyed with the prefix."""
    metadata = FileSystemReader(path).read_metadata()
    return {key: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)}


def read_rows(path: Path, meta: TensorStorageMetadata, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
    """A model tensor of the checkpoint, whole (consolidated from every rank's shards), or only its rows
    [start, stop) along dim 0 (an expert range of a stacked expert weight): nothing else is read."""
    start, stop = rows or (0, meta.size[0])
    box = torch.empty((stop - start, *meta.size[1:]), dtype=meta.properties.dtype)
    dcp.load({key: BoxedTensor(meta.size, [((start, *(0,) * (len(meta.size) - 1)), box)])},
             storage_reader=FileSystemReader(path), planner=BoxedLoadPlanner(), no_dist=True)
    return box


def model_config(config: dict[str, Any]) -> ModelConfig:
    return build(ModelConfig, config["model"], "model")


class OutTensor(Protocol):
    """One exported tensor: its name, shape and dtype there, and where it comes from."""

    name: str
    ours: str
    expert: int | None
    shape: tuple[int, ...]
    kind: str

    @property
    def dtype(self) -> torch.dtype: ...

    def to_hf(self, ours: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class SameTensor:
    """A tensor exported under our own name, as it is."""

    name: str
    ours: str
    expert: None
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    kind: str = "same"

    @property
    def dtype(self) -> torch.dtype:
        return self.source_dtype

    def to_hf(self, ours: torch.Tensor) -> torch.Tensor:
        return ours


def model_card(config: dict[str, Any]) -> dict[str, Any]:
    """Our resolved config's model section, under docs/model.md's names."""
    m = config["model"]
    return {
        "architecture": "hybrid KDA + gated MLA, AttnRes, Stable LatentMoE (moe-pretrain)",
        "vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "num_layers": m["num_layers"],
        "layer_types": [MIXER_LETTERS[c] for c in m["layer_pattern"]],
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
        "vision": {"patch_size": m["vision"]["patch_size"], "channels": m["vision"]["channels"],
                   "encoder": dict(m["vision"]["encoder"])},
    }


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _same(metadata: dict[str, TensorStorageMetadata], keys: list[str]) -> list[OutTensor]:
    return [SameTensor(key[len(PREFIX):], key[len(PREFIX):], None, tuple(metadata[key].size),
                       metadata[key].properties.dtype) for key in sorted(keys)]


def plan_layout(layout: str, metadata: dict[str, TensorStorageMetadata], config: dict[str, Any],
                experts: str = "mxfp4") -> tuple[list[OutTensor], list[OutTensor]]:
    """(tensors of the layout, our tensors it has no place for) for a checkpoint; every released tensor's
    source must exist with the shape the layout needs."""
    if layout == "native":
        return _same(metadata, list(metadata)), []
    tensors = kimi_k3_tensors(model_config(config), experts)
    for tensor in tensors:
        meta = metadata.get(PREFIX + tensor.ours)
        if meta is None:
            raise ValueError(f"{tensor.name}: the checkpoint has no {PREFIX}{tensor.ours}")
    used = {PREFIX + t.ours for t in tensors}
    return tensors, _same(metadata, [key for key in metadata if key not in used])


def bounded_files(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Consecutive tensors in files of at most max_shard_bytes (a larger tensor alone in its file)."""
    plan: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor.shape, tensor.dtype)
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(tensor)
        size += nbytes
    return plan


def write_shards(path: Path, out: Path, metadata: dict[str, TensorStorageMetadata], plan: list[list[OutTensor]],
                 name_of: Any, workers: int = 1) -> dict[str, str]:
    """Write each planned file (name_of(index, count): its name), over `workers` processes (each file whole in
    one, the largest first: MXFP4 encoding is CPU-bound); returns the weight map."""
    named = [(name_of(i, len(plan)), shard) for i, shard in enumerate(plan, start=1)]
    jobs = [(path, out / name, metadata, shard) for name, shard in named]
    if workers > 1:
        jobs.sort(key=lambda job: -sum(_nbytes(t.shape, t.dtype) for t in job[3]))
        with multiprocessing.get_context("spawn").Pool(workers, _threads_per_worker, (workers,)) as pool:
            pool.starmap(_write_file, jobs, chunksize=1)
    else:
        for job in jobs:
            _write_file(*job)
    return {tensor.name: name for name, shard in named for tensor in shard}


def _native_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _threads_per_worker(workers: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _write_file(path: Path, file: Path, metadata: dict[str, TensorStorageMetadata], shard: list[OutTensor]) -> None:
    save_file(_read_shard(path, metadata, shard), str(file), metadata={"format": "pt"})


def _read_shard(path: Path, metadata: dict[str, TensorStorageMetadata], shard: list[OutTensor]
                ) -> dict[str, torch.Tensor]:
    """One file's tensors: each source read once, a stacked expert weight only over the experts needed."""
    sources: dict[str, list[OutTensor]] = {}
    for tensor in shard:
        sources.setdefault(tensor.ours, []).append(tensor)
    out = {}
    for ours, made in sources.items():
        experts = [t.expert for t in made if t.expert is not None]
        rows = (min(experts), max(experts) + 1) if experts else None
        source = read_rows(path, metadata[PREFIX + ours], PREFIX + ours, rows)
        per_expert: dict[int | None, list[OutTensor]] = {}
        for tensor in made:
            per_expert.setdefault(tensor.expert, []).append(tensor)
        for expert, tensors in per_expert.items():
            out.update(to_release(tensors, source if expert is None else source[expert - rows[0]]))
        del source
    return out


def export(path: Path, out: Path, max_shard_bytes: int = 1 << 30, layout: str = "native",
           experts: str = "mxfp4", workers: int = 1) -> list[Path]:
    """Write the checkpoint's model in `layout` (LAYOUTS) into the new directory `out`; returns its files.
    max_shard_bytes bounds the native layout's files; kimi-k3-hf writes the release's files, its routed experts
    in `experts` (kimi_k3.EXPERT_FORMATS); `workers` processes write the files."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    metadata = model_tensor_metadata(path)
    config = read_trainer_state(path)["config"]
    tensors, extras = plan_layout(layout, metadata, config, experts)
    out.mkdir(parents=True, exist_ok=False)
    if layout == "native":
        files = bounded_files(tensors, max_shard_bytes)
        weight_map = write_shards(path, out, metadata, files, _native_file_name, workers)
        card = model_card(config)
    else:
        weight_map = write_shards(path, out, metadata, release_files(tensors), release_file_name, workers)
        card = release_config(model_config(config), quantized=experts == "mxfp4",
                              tokens=release_token_ids(read_trainer_state(path).get("token_ids", {})))
        (out / RUN_CONFIG).write_text(json.dumps({"config": config, "card": model_card(config)}, indent=1))
    total = sum(_nbytes(t.shape, t.dtype) for t in tensors)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    if extras:
        save_file(_read_shard(path, metadata, extras), str(out / EXTRAS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(card, indent=1))
    return sorted(out.glob("model-*.safetensors"))
