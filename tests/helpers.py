"""Shared test helpers: relative-RMS comparison with the tolerance stated at each call site, reading a run
directory's metrics."""

import json
from pathlib import Path

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / max(||expected||_rms, tiny): the fla-style per-tensor error."""
    actual, expected = actual.detach(), expected.detach()
    diff = (actual.double() - expected.double()).pow(2).mean().sqrt()
    scale = expected.double().pow(2).mean().sqrt().clamp_min(1e-30)
    return float(diff / scale)


def steps_done(run_dir: Path) -> int:
    """Steps recorded in run_dir/metrics.jsonl so far (0 before the file exists)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
