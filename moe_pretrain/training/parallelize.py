"""Apply the parallel layout to a model built whole, from outside its math (torchtitan's approach).

Every rank builds the full model from the same seed, so the initial weights never depend on the
layout; then each rank keeps its share: with expert parallelism, its contiguous block of experts and
an all-to-all dispatcher; with data parallelism, balancing statistics over the data-parallel group.
(At full size the whole model does not fit one host: building on the meta device with per-parameter
seeded initialisation is the planned replacement; see README.)
"""

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.model import MoETransformer
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.moe import LatentMoE
from parallel.all_to_all_dispatch import AllToAllTokenDispatcher
from parallel.state import ParallelContext
from parallel.statistics import GroupStatistics


def parallelize_model(model: MoETransformer, ctx: ParallelContext) -> MoETransformer:
    if not ctx.distributed:
        return model
    for module in model.modules():
        if isinstance(module, LatentMoE) and ctx.layout.ep > 1:
            dispatcher = AllToAllTokenDispatcher(module.cfg.num_experts, ctx.ep_group, ctx.ep_rank)
            module.dispatcher = dispatcher
            module.experts.keep_experts(dispatcher.first_local_expert, dispatcher.num_local_experts)
    for router in model.routers().values():
        router.balancer.stats = GroupStatistics(ctx.dp_group)
    return model


def is_expert_parameter(param: nn.Parameter) -> bool:
    return getattr(param, "is_expert", False)


@torch.no_grad()
def gather_full_state(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The single-process state dict (global expert indices), assembled on every rank."""
    state = {}
    expert_names = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, GroupedExperts)
                    for p in ("w_gate", "w_up", "w_down")}
    for name, tensor in model.state_dict().items():
        if name in expert_names and ctx.layout.ep > 1:
            parts = [torch.empty_like(tensor) for _ in range(ctx.layout.ep)]
            dist.all_gather(parts, tensor.contiguous(), group=ctx.ep_group)
            tensor = torch.cat(parts)
        state[name] = tensor.clone()
    return state
