"""Does an intact checkpoint fit this run? Asked before a checkpoint is verified, loaded or moved aside.

A checkpoint saved by another model (model.hidden_size changed, other expert counts, another optimizer) is not
damaged: every byte of it is still good. Verifying it would pass and loading it would fail on a tensor's shape,
which resume=auto would report as damage (and item 1 of the fault policy would move it aside). So the run's
tensors are compared with the checkpoint's own metadata first, and a checkpoint that does not fit stops the run
with CheckpointMismatchError, naming the config keys that differ between the config saved in the checkpoint and this
run's, with nothing touched. Settings that change no tensor (a balancing rate, a loss weight, a RoPE base) may
change on resume: they are only reported.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_pretrain.checkpoint.store import CheckpointMismatchError

SHOWN = 4
"""Tensors named per mismatch message (the rest are counted)."""
COMPARED = ("model", "optim.name")
__all__ = ["CheckpointMismatchError", "config_differences", "mismatch_message", "saved_tensor_shapes",
           "tensor_differences"]
"""The parts of the saved config that decide which tensors a checkpoint holds, and their shapes."""


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'model.hidden_size: checkpoint 128, this run 96' for every compared key whose value differs."""
    theirs, ours = _flat(saved), _flat(current)
    keys = sorted(k for k in theirs.keys() | ours.keys() if any(k == c or k.startswith(c + ".") for c in COMPARED))
    missing = "(absent)"
    return [f"{k}: checkpoint {theirs.get(k, missing)}, this run {ours.get(k, missing)}"
            for k in keys if theirs.get(k, missing) != ours.get(k, missing)]


def saved_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's global shape in the checkpoint's DCP metadata; None when it cannot be read (damage, which
    verification names)."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception:  # an unreadable .metadata is damage: verify() reports it by file
        return None
    return {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def tensor_differences(saved: Mapping[str, tuple[int, ...]], wanted: Mapping[str, tuple[int, ...]]) -> list[str]:
    """This rank's tensors that the checkpoint lacks or holds in another global shape."""
    lines = []
    for key, shape in wanted.items():
        if key not in saved:
            lines.append(f"{key}: not in the checkpoint")
        elif tuple(saved[key]) != tuple(shape):
            lines.append(f"{key}: checkpoint {list(saved[key])}, this run {list(shape)}")
    return lines


def mismatch_message(path: Path, config_lines: list[str], tensor_lines: list[str], unplaced: int) -> str | None:
    """The one-line refusal for a checkpoint that does not fit (None when it fits): the differing config keys
    first (what the user changed), then the tensors as evidence."""
    if not tensor_lines and unplaced <= 0:
        return None
    evidence = tensor_lines[:SHOWN] + ([f"{len(tensor_lines) - SHOWN} more tensors"] if len(tensor_lines) > SHOWN
                                       else [])
    if unplaced > 0:
        evidence.append(f"{unplaced} of its model tensors have no place in this model")
    changed = "; ".join(config_lines) if config_lines else "no model or optim.name key differs from the saved config"
    return (f"checkpoint {path} is intact but was saved by another model or optimizer: {changed} "
            f"({'; '.join(evidence)}). Nothing was changed: resume with the checkpoint's settings, or start a new "
            "run (another train.run_dir, or train.resume=none with another checkpoint.dir)")
