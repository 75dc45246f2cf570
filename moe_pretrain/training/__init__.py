"""Training loop, optimizer and schedules, metrics."""

from moe_pretrain.training.trainer import Trainer

__all__ = ["Trainer"]
