"""Offline resharding: rewrite a checkpoint as another layout would have saved it (or consolidate it).

Resuming never needs this (every layout loads every checkpoint through DCP); it pre-splits files for
a target layout, or consolidates them for tools. Each process of the target world builds a TrainingState
from the checkpoint's own config with the new parallel settings (no trainer, no data pipeline): its model
is built on the meta device and only this rank's shards are allocated, uninitialised, so each process
holds its share of the state and no more; DCP fills it in place from the source and writes it out. The
data position and RNG states are carried over unchanged.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpu_kernels.fast_paths import state_kernels
from launch.local import run_distributed
from moe_pretrain.checkpoint import read_trainer_state
from moe_pretrain.config import load_config
from moe_pretrain.planning.measured import LiveTensorBytes, peak_resident_bytes, reset_peak, resident_bytes
from moe_pretrain.training.state import TrainingState
from parallel.state import destroy_parallel, init_parallel


@dataclass(frozen=True)
class ReshardResult:
    path: Path
    """The new step directory."""
    peak_bytes: int
    """Rank 0's peak resident memory while building, loading and saving, above its resident memory before."""
    peak_tensor_bytes: int
    """Rank 0's peak of live tensor bytes over the same (exact; memory.LiveTensorBytes)."""
    state_bytes: int
    """What rank 0's share of the state takes: parameters plus Adam moments."""


def _worker(rank: int, world_size: int, source: str, target: str, overrides: list[str]
            ) -> tuple[str, int, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        config = read_trainer_state(Path(source))["config"]
        # Micro-batch counts were resolved for the source's pipeline depth: derive them again for the
        # target's (the --set overrides below still win).
        for section in [config["data"], *config.get("stages", [])]:
            section["micro_batches"] = 0
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        cfg = load_config(config_file, [*overrides, f"checkpoint.dir={target}", f"train.run_dir={tmp}/run",
                                        "logging.progress=false"])
        ctx = init_parallel(cfg)
        try:
            before = resident_bytes()
            reset_peak()
            with LiveTensorBytes() as live:
                state = TrainingState(cfg, ctx, draw_values=False, kernels=state_kernels(cfg))
                state.load(Path(source))
                path = state.save(Path(target))
            held = sum(p.numel() * p.element_size() for p in state.model.parameters())
            return str(path), peak_resident_bytes() - before, live.peak, held + state.optimizer.state_bytes()
        finally:
            destroy_parallel()


def reshard(source: Path, target: Path, world_size: int, overrides: list[str]) -> ReshardResult:
    """Write `source` into the checkpoint root `target` with `world_size` processes and `overrides`
    (e.g. parallel.tp=2)."""
    if world_size == 1:
        path, peak, tensors, state = _worker(0, 1, str(source), str(target), overrides)
    else:
        path, peak, tensors, state = run_distributed(_worker, world_size, str(source), str(target), overrides,
                                                     timeout=3600)
    return ReshardResult(Path(path), peak, tensors, state)
