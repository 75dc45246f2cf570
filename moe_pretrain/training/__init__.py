"""Training loop, optimizer and schedules, metrics.

Trainer is imported when first asked for: it brings torch, and launch/train.py reads how an earlier worker group
ended (outcome.py) before any of that is imported."""

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from moe_pretrain.training.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
