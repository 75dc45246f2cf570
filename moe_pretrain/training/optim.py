"""The optimizer (ZeRO-1 sharded AdamW) and the learning-rate schedules.

Vectors (norm weights, biases, A_log, dt_bias, AttnRes norm weights) take no weight decay: decaying
them pulls gains and decay rates toward 0, which MODEL.md rules out for A_log and dt_bias.
The vision tower and projector learn at optim.vision_lr_scale times the rate, ramped over
optim.vision_warmup_steps.
Reduction groups come from the sharding plan (parallel/plan.py): expert shards over expert-data
parallel, tensor-parallel slices over data parallel, replicated parameters over tensor x data parallel.
"""

import math

import torch.distributed as dist
from torch import nn

from moe_pretrain.config import Config, OptimConfig
from parallel.optimizer import ParamGroupSpec, ShardedAdamW
from parallel.plan import ShardingPlan
from parallel.state import ParallelContext

VISION = ("vision_tower.", "mm_projector.")
"""Parameters that learn at optim.vision_lr_scale times the schedule's rate (after optim.vision_warmup_steps)."""


def build_optimizer(model: nn.Module, cfg: Config, ctx: ParallelContext, plan: ShardingPlan) -> ShardedAdamW:
    reduce_group = {name: plan.placement(name).reduce_group for name, _ in model.named_parameters()}
    specs = []
    for group_name in ("edp_group", "dp_group", "tp_dp_group"):
        for decay in (True, False):
            for vision in (False, True):
                params = [p for name, p in model.named_parameters()
                          if p.requires_grad and reduce_group[name] == group_name and (p.dim() >= 2) == decay
                          and name.startswith(VISION) == vision]
                o = cfg.optim
                specs.append(ParamGroupSpec(params, getattr(ctx, group_name), o.weight_decay if decay else 0.0,
                                            o.vision_lr_scale if vision else 1.0,
                                            o.vision_warmup_steps if vision else 0))
    o = cfg.optim
    optimizer = ShardedAdamW(specs, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             bucket_bytes=int(cfg.parallel.bucket_mb * 2**20),
                             norm_group=dist.group.WORLD if ctx.distributed else None,
                             param_order=[p for p in model.parameters() if p.requires_grad])
    if cfg.parallel.overlap_param_gather:
        optimizer.gate_parameter_use(model, parameter_units(model))
    return optimizer


def parameter_units(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward alone reads their parameters, for the all-gather's waits: the model's
    children (embeddings, final mix, norm, head), the layers inside its layer container one by one."""
    units = []
    for child in model.children():
        units.extend(child.values() if isinstance(child, nn.ModuleDict) else [child])
    return units


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
