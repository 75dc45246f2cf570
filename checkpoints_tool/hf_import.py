"""A released-layout (kimi-k3-hf) directory into a checkpoint this system resumes from (continued pretraining).

The result is a model-only checkpoint at step 0: the model's tensors under their global keys, sealed with
the usual manifest, and a trainer_state that says model_only, so resuming from it loads the weights into
any layout, starts the optimizer fresh (Adam moments zero, as megatron-core's --no-load-optim and
torchtitan's model-only initial load do) and the data from its beginning.

The model comes from the directory's config.json alone (kimi_k3_config.model_section: every key mapped, what our
model cannot represent refused by name, the rest listed in the import's notes); a training config and overrides
may still set the run's other sections. Routed experts stored as MXFP4 (the release) are decoded exactly into
the stacked expert weights; bf16 ones (our `--experts bf16` export) are read as they are.

It streams: the checkpoint's tensors are planned from shapes alone (the meta model of the config) and each
piece is read from the safetensors files only when DCP writes it, one file per piece, so memory peaks at one
piece per process (a stacked expert weight is cut into pieces of at most PIECE_BYTES), never the model: the same
code imports a full-size release on one host. With N processes (`import_in_workers`, or torchrun ranks) the
pieces are dealt by bytes (largest first to the least loaded) and each process reads, decodes and writes its own,
one collective save committing them all.
"""

import json
import math
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.planner import WriteItem

from checkpoints_tool import ImportWorkerError
from moe_pretrain.checkpoint import mxfp4
from moe_pretrain.checkpoint.directory import step_dir
from moe_pretrain.checkpoint.export import EXTRAS
from moe_pretrain.checkpoint.kimi_k3 import HFTensor, by_source, kimi_k3_tensors
from moe_pretrain.checkpoint.kimi_k3_config import model_section, special_ids_of_release
from moe_pretrain.checkpoint.store import save
from moe_pretrain.config import Config, config_to_dict, load_config
from moe_pretrain.dtypes import parameter_dtype
from moe_pretrain.model.meta import meta_model
from parallel.collectives import all_reduce_sum
from parallel.flat_shards import BoxedSavePlanner, BoxedTensor

PIECE_BYTES = 1 << 30
"""Largest piece of a stacked expert weight written (and held) at once."""
INDEX = "model.safetensors.index.json"


@dataclass
class ImportStats:
    """What an import read, for its throughput line, and how many MXFP4 groups would not re-encode to the same
    bytes (mxfp4.reencodes_exactly: an export writes the same values with other codes there)."""

    bytes_read: int = 0
    seconds: float = 0.0
    mxfp4_groups: int = 0
    mxfp4_groups_reencoded_differently: int = 0
    notes: list[str] = field(default_factory=list)


class _Files:
    """Lazy reads from the directory's safetensors files, by tensor name."""

    def __init__(self, directory: Path, weight_map: dict[str, str], stats: ImportStats):
        self.directory, self.weight_map, self.stats = directory, weight_map, stats
        self._open: dict[str, Any] = {}

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.directory / file), framework="pt")
        tensor = self._open[file].get_tensor(name)
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} in {file}, the config gives {shape}")
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def mxfp4(self, packed: HFTensor, scale: HFTensor, dtype: torch.dtype) -> torch.Tensor:
        """An expert weight decoded from its codes and scales."""
        codes, scales = self.read(packed.name, packed.shape), self.read(scale.name, scale.shape)
        self.stats.mxfp4_groups += scales.numel()
        self.stats.mxfp4_groups_reencoded_differently += int((~mxfp4.reencodes_exactly(codes, scales)).sum())
        return mxfp4.decode(codes, scales, dtype)


class _ProducingPlanner(BoxedSavePlanner):
    """Save planner whose boxes are meta placeholders: each is produced from the source files when DCP writes
    it (producers: (key, box offsets) -> tensor)."""

    def __init__(self, producers: dict[tuple[str, tuple[int, ...]], Any]):
        super().__init__()
        self.producers = producers

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        produce = self.producers[(write_item.index.fqn, tuple(write_item.index.offset))]
        return produce()


def release_run_config(directory: Path, config_file: Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                       ) -> tuple[Config, bool, list[str]]:
    """(the run config for importing `directory`: its model from config.json, the other sections from config_file
    or the defaults, then overrides; whether its experts are MXFP4; the notes of the mapping)."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; import reads the model from the checkpoint's config.json")
    values, quantized, notes = model_section(json.loads(path.read_text()))
    return load_config(config_file, overrides, values=values), quantized, notes


def import_hf(directory: Path, root: Path, cfg: Config, experts: str = "mxfp4", notes: list[str] | None = None,
              group: dist.ProcessGroup | None = None) -> tuple[Path, ImportStats]:
    """Write the kimi-k3-hf directory (routed experts in `experts`) as a model-only checkpoint step_00000000 under
    `root`; returns it and what was read (by every process of `group`, which share the work)."""
    if step_dir(root, 0).exists():
        raise FileExistsError(f"{step_dir(root, 0)} exists; import into an empty checkpoint directory")
    index = directory / INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{index}: missing; {directory} is not a safetensors checkpoint directory")
    start = time.perf_counter()
    stats = ImportStats(notes=list(notes or []))
    weight_map = dict(json.loads(index.read_text())["weight_map"])
    released = kimi_k3_tensors(cfg.model, experts)
    missing = [t.name for t in released if t.name not in weight_map]
    if missing:
        raise ValueError(f"{index}: {len(missing)} tensors of the config's layout are missing, e.g. {missing[:3]}")
    extras = directory / EXTRAS
    if extras.is_file():
        with safe_open(str(extras), framework="pt") as f:
            weight_map.update({name: EXTRAS for name in f.keys()})
    files = _Files(directory, weight_map, stats)
    model = meta_model(cfg.model)
    params = dict(model.named_parameters())
    sources = by_source(released)
    planned = []  # (key, global shape, dtype, offsets, sizes, produce)
    absent_blocks: set[str] = set()
    for name, meta in model.state_dict().items():
        dtype = parameter_dtype(cfg.train.dtype) if name in params else meta.dtype
        if name in sources:
            pieces = _pieces(name, tuple(meta.shape), sources[name], files, cfg, dtype)
        elif name in weight_map:  # in the side file, under our own name
            pieces = [((0,) * meta.dim(), tuple(meta.shape), lambda n=name, d=dtype: files.read(n).to(d))]
        elif name.startswith("mtp."):  # the release has no multi-token-prediction block: training initializes ours
            absent_blocks.add(name.split(".")[1])
            continue
        else:
            raise ValueError(f"{directory}: nothing holds our model's {name} (the released layout has no place "
                             f"for it and {EXTRAS} is absent or lacks it)")
        planned += [(f"model.{name}", meta.shape, dtype, *piece) for piece in pieces]
    if absent_blocks:
        stats.notes.append(f"model.mtp.layers={len(absent_blocks)}: {directory} holds no multi-token-prediction "
                           f"block; the run that resumes this checkpoint starts them from their initialization")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    boxes: dict[str, list] = {}
    producers = {}
    for key, shape, dtype, offsets, sizes, produce in _dealt(planned, world)[rank]:
        boxes.setdefault(key, [shape, []])[1].append((offsets, torch.empty(sizes, dtype=dtype, device="meta")))
        producers[(key, offsets)] = produce
    tensors = {key: BoxedTensor(torch.Size(shape), pieces) for key, (shape, pieces) in boxes.items()}
    config_json = directory / "config.json"
    state = {"step": 0, "tokens_seen": 0, "data": {}, "config": config_to_dict(cfg), "rng": None,
             "model_only": True, "imported_from": str(directory.resolve()), "import_notes": stats.notes,
             "token_ids": special_ids_of_release(json.loads(config_json.read_text())) if config_json.is_file() else {}}
    info = {"tokens": 0, "model_only": True, "layout_text": f"model only, imported from {directory.resolve()}"}
    path = save(root, 0, tensors, state, info, keep_last=1, planner=_ProducingPlanner(producers), keep_every=0,
                file_per_item=True, group=group)
    if group is not None:
        counts = all_reduce_sum(torch.tensor([stats.bytes_read, stats.mxfp4_groups,
                                              stats.mxfp4_groups_reencoded_differently]), group)
        stats.bytes_read, stats.mxfp4_groups, stats.mxfp4_groups_reencoded_differently = map(int, counts)
    stats.seconds = time.perf_counter() - start
    return path, stats


def _dealt(planned: list[tuple], world: int) -> list[list[tuple]]:
    """The pieces dealt over `world` processes by bytes, largest first to the least loaded (the same deal on every
    process: the plan is built from the config alone)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for piece in sorted(planned, key=lambda p: -math.prod(p[4]) * p[2].itemsize):
        least = loads.index(min(loads))
        shares[least].append(piece)
        loads[least] += math.prod(piece[4]) * piece[2].itemsize
    return shares


def _worker(rank: int, world: int, port: int, args: tuple, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        path, stats = import_hf(*args, group=dist.group.WORLD)
        if rank == 0:
            results.put((path, stats))
    finally:
        dist.destroy_process_group()


def import_in_workers(directory: Path, root: Path, cfg: Config, experts: str = "mxfp4",
                      notes: list[str] | None = None, workers: int = 1) -> tuple[Path, ImportStats]:
    """import_hf over `workers` local processes (gloo), each converting its share of the pieces."""
    if workers == 1:
        return import_hf(directory, root, cfg, experts, notes)
    from launch.local import free_port

    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, workers, port, (directory, root, cfg, experts, notes),
                                                       results)) for rank in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode]
    if failed or results.empty():
        raise ImportWorkerError(f"worker ranks {failed} of {workers} failed (their errors are printed above); nothing "
                           f"was committed under {root}")
    return results.get()


def _pieces(name: str, shape: tuple[int, ...], made: list[HFTensor], files: _Files, cfg: Config,
            dtype: torch.dtype) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
    """(offsets, sizes, produce) of the pieces our tensor `name` is written in."""
    heads = cfg.model.kda.num_heads
    if made[0].expert is None:
        return [((0,) * len(shape), shape, lambda: made[0].from_hf(files.read(made[0].name), heads, dtype))]
    per_expert: dict[int, dict[str, HFTensor]] = {}
    for t in made:
        per_expert.setdefault(t.expert, {})[t.kind] = t

    def expert(e: int) -> torch.Tensor:
        stored = per_expert[e]
        if "same" in stored:
            return stored["same"].from_hf(files.read(stored["same"].name), heads, dtype)
        return files.mxfp4(stored["mxfp4_packed"], stored["mxfp4_scale"], dtype)

    step = max(1, PIECE_BYTES // (math.prod(shape[1:]) * dtype.itemsize))
    pieces = []
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])

        def produce(start: int = start, stop: int = stop) -> torch.Tensor:
            return torch.stack([expert(e) for e in range(start, stop)])
        pieces.append(((start, *(0,) * (len(shape) - 1)), (stop - start, *shape[1:]), produce))
    return pieces
