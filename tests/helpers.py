"""Shared test helpers: relative-RMS comparison with the tolerance stated at each call site."""

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / max(||expected||_rms, tiny): the fla-style per-tensor error."""
    actual, expected = actual.detach(), expected.detach()
    diff = (actual.double() - expected.double()).pow(2).mean().sqrt()
    scale = expected.double().pow(2).mean().sqrt().clamp_min(1e-30)
    return float(diff / scale)
