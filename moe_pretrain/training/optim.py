"""The optimizer (ZeRO-1 sharded AdamW, or Per-Head Muon for the matrices) and the learning-rate schedules.

Vectors (norm weights, biases, A_log, dt_bias, AttnRes norm weights) take no weight decay: decaying
them pulls gains and decay rates toward 0, which docs/model.md rules out for A_log and dt_bias.
The vision tower and projector learn at optim.vision_lr_scale times the rate, ramped over
optim.vision_warmup_steps.
Reduction groups come from the sharding plan (parallel/plan.py): expert shards over expert-data
parallel, tensor-parallel slices over data parallel, replicated parameters over tensor x data parallel.
With optim.name=muon each of those groups splits in two: the parameters training/muon_params.py gives to Muon
(with the view Muon takes of each: per-head blocks, experts as a batch, the tensor-parallel dimension to join)
and the rest, AdamW's.
With train.param_dtype=bfloat16 the matmuls' weights (model/linear.py cast_weight_names) are held in bf16 and
the optimizer keeps their fp32 masters (parallel/optimizer.py).
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.config import Config, OptimConfig
from moe_pretrain.model.linear import cast_weight_names
from moe_pretrain.training.muon_params import as_matrices, muon_rule
from parallel.muon import MatrixSpec
from parallel.optimizer import ParamGroupSpec, ShardedOptimizer
from parallel.plan import ParamPlacement, ShardingPlan
from parallel.state import ParallelContext

VISION = ("vision_tower.", "mm_projector.")
"""Parameters that learn at optim.vision_lr_scale times the schedule's rate (after optim.vision_warmup_steps)."""


def build_optimizer(model: nn.Module, cfg: Config, ctx: ParallelContext, plan: ShardingPlan) -> ShardedOptimizer:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    placement = {name: plan.placement(name) for name, _ in named}
    matrix = {name: muon_matrix(name, p, cfg, placement[name], ctx.layout.tp) for name, p in named}
    o = cfg.optim
    specs = []
    for group_name in ("edp_group", "dp_group", "tp_dp_group"):
        for decay in (True, False):
            for vision in (False, True):
                chosen = [(name, p) for name, p in named if placement[name].reduce_group == group_name
                          and (p.dim() >= 2) == decay and name.startswith(VISION) == vision]
                settings = (getattr(ctx, group_name), o.weight_decay if decay else 0.0,
                            o.vision_lr_scale if vision else 1.0, o.vision_warmup_steps if vision else 0)
                specs.append(ParamGroupSpec([p for name, p in chosen if matrix[name] is None], *settings))
                muon = [(p, matrix[name]) for name, p in chosen if matrix[name] is not None]
                if muon:
                    specs.append(ParamGroupSpec([p for p, _ in muon], *settings, matrices=[m for _, m in muon]))
    low = cast_weight_names(model) if cfg.train.param_dtype == "bfloat16" else frozenset()
    optimizer = ShardedOptimizer(specs, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 bucket_bytes=int(cfg.parallel.bucket_mb * 2**20),
                                 norm_group=dist.group.WORLD if ctx.distributed else None,
                                 param_order=[p for p in model.parameters() if p.requires_grad],
                                 momentum=o.muon_momentum, tp_group=ctx.tp_group,
                                 held_in={id(p): torch.bfloat16 for name, p in named if name in low},
                                 held_grad_dtype=torch.bfloat16 if cfg.train.grad_dtype == "bfloat16" else None)
    if cfg.parallel.overlap_param_gather:
        optimizer.gate_parameter_use(model, parameter_units(model))
    return optimizer


def muon_matrix(name: str, param: nn.Parameter, cfg: Config, placement: ParamPlacement, tp: int
                ) -> MatrixSpec | None:
    """How Muon sees this rank's `param` (None: AdamW takes it, or optim.name is adamw): its matrices, their
    head blocks, and the tensor-parallel dimension to join when a whole-matrix rule meets a tensor slice."""
    rule = muon_rule(name, param, cfg.model) if cfg.optim.name == "muon" else None
    if rule is None:
        return None
    matrices = as_matrices(param)
    shape = (1, *matrices.shape) if matrices.dim() == 2 else tuple(matrices.shape)
    joined = placement.tensor_dim is not None and tp > 1 and rule.head_rows == 0
    return MatrixSpec(shape, rule.head_rows, placement.tensor_dim - 2 if joined else None)


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
