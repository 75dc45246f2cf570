"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules.

Vectors (norm weights, biases, A_log, dt_bias, AttnRes norm weights) take no weight decay: decaying
them pulls gains and decay rates toward 0, which MODEL.md rules out for A_log and dt_bias.
"""

import math

import torch
from torch import nn

from moe_pretrain.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def learning_rate(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """LR for 0-based optimizer step `step`: linear warmup, then cosine to min_lr or WSD."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    decay_steps = max(round(total_steps * cfg.decay_fraction), 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress
