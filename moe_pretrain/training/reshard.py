"""Offline resharding: rewrite a checkpoint as another layout would have saved it (or consolidate it).

Resuming never needs this (every layout loads every checkpoint through DCP); it pre-splits files for
a target layout, or consolidates them for tools. Each process of the target world builds the model
from the checkpoint's own config with the new parallel settings, loads, and saves the same step.
"""

import json
import tempfile
from pathlib import Path

import yaml

from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.training.trainer import Trainer
from parallel.state import destroy_parallel, init_parallel


def _config_file(source: Path, directory: Path) -> Path:
    config = json.loads((source / "trainer_state.json").read_text())["config"]
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _worker(rank: int, world_size: int, source: str, target: str, overrides: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(_config_file(Path(source), Path(tmp)), [
            *overrides, f"train.resume={source}", f"checkpoint.dir={target}", f"train.run_dir={tmp}/run",
            "logging.progress=false"])
        ctx = init_parallel(cfg)
        try:
            trainer = Trainer(cfg, ctx)
            trainer.resume()
            return str(trainer.save_checkpoint())
        finally:
            destroy_parallel()


def reshard(source: Path, target: Path, world_size: int, overrides: list[str]) -> Path:
    """Write `source` into the checkpoint root `target` with `world_size` processes and `overrides`
    (e.g. parallel.tp=2); returns the new step directory."""
    if world_size == 1:
        return Path(_worker(0, 1, str(source), str(target), overrides))
    return Path(run_distributed(_worker, world_size, str(source), str(target), overrides, timeout=3600))
