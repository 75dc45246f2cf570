"""The optimizer (ZeRO-1 sharded AdamW) and the learning-rate schedules.

Vectors (norm weights, biases, A_log, dt_bias, AttnRes norm weights) take no weight decay: decaying
them pulls gains and decay rates toward 0, which MODEL.md rules out for A_log and dt_bias.
Reduction groups: expert parameters over expert-data parallel; tensor-parallel slices over data
parallel; replicated parameters, whose gradients are partial over the sequence shards, over tensor x
data parallel.
"""

import math

import torch.distributed as dist
from torch import nn

from moe_pretrain.config import Config, OptimConfig
from parallel.optimizer import ParamGroupSpec, ShardedAdamW
from parallel.params import is_expert_parameter, tensor_parallel_dim
from parallel.state import ParallelContext


def build_optimizer(model: nn.Module, cfg: Config, ctx: ParallelContext) -> ShardedAdamW:
    def reduction(p):
        if is_expert_parameter(p):
            return "expert"
        return "sharded" if tensor_parallel_dim(p) is not None else "replicated"

    groups = {"expert": ctx.edp_group, "sharded": ctx.dp_group, "replicated": ctx.tp_dp_group}
    specs = []
    for kind, group in groups.items():
        for decay in (True, False):
            params = [p for p in model.parameters()
                      if p.requires_grad and reduction(p) == kind and (p.dim() >= 2) == decay]
            specs.append(ParamGroupSpec(params, group, cfg.optim.weight_decay if decay else 0.0))
    o = cfg.optim
    return ShardedAdamW(specs, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                        bucket_bytes=int(cfg.parallel.bucket_mb * 2**20),
                        norm_group=dist.group.WORLD if ctx.distributed else None)


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
