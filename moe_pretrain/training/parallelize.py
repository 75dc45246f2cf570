"""Apply the parallel layout to a model built whole, from outside its math (torchtitan's approach).

Every rank builds the full model from the same seed, so the initial weights never depend on the
layout; then each rank keeps its share:
- tensor + sequence parallel: column/row projections sliced by their declared style, KDA's per-head
  parameters sliced by head, the vocab-parallel embedding, and activations split along T between
  the tensor-parallel regions;
- expert parallel: its contiguous block of experts and an all-to-all dispatcher;
- balancing statistics over every token of the global batch (tensor x data parallel group).
(At full size the whole model does not fit one host: building on the meta device with per-parameter
seeded initialisation is the planned replacement; see README.)
"""

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.model import MoETransformer
from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.moe import LatentMoE
from parallel.all_to_all_dispatch import AllToAllTokenDispatcher
from parallel.linear import LinearStyle
from parallel.params import is_expert_parameter, tensor_parallel_dim
from parallel.sequence import SequenceParallel
from parallel.state import ParallelContext
from parallel.statistics import GroupStatistics
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, vocab_parallel_embedding

TP_LAYERS = {LinearStyle.COLUMN: ColumnParallelLinear, LinearStyle.ROW: RowParallelLinear}


def apply_tensor_parallel(model: MoETransformer, ctx: ParallelContext) -> None:
    group = ctx.tp_group
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            style = getattr(child, "parallel_style", None)
            if isinstance(child, nn.Linear) and style in TP_LAYERS:
                setattr(parent, name, TP_LAYERS[style](child, group))
        if isinstance(parent, KimiDeltaAttention):
            parent.shard_heads(ctx.tp_rank, ctx.layout.tp)
    model.embedding = vocab_parallel_embedding(model.embedding, group)
    model.sequence = SequenceParallel(group)


def parallelize_model(model: MoETransformer, ctx: ParallelContext) -> MoETransformer:
    if not ctx.distributed:
        return model
    if ctx.layout.tp > 1:
        apply_tensor_parallel(model, ctx)
    for module in model.modules():
        if isinstance(module, LatentMoE) and ctx.layout.ep > 1:
            dispatcher = AllToAllTokenDispatcher(module.cfg.num_experts, ctx.ep_group, ctx.ep_rank)
            module.dispatcher = dispatcher
            module.experts.keep_experts(dispatcher.first_local_expert, dispatcher.num_local_experts)
    for router in model.routers().values():
        router.balancer.stats = GroupStatistics(ctx.tp_dp_group)
    return model


def _all_gather_cat(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def gather_full_state(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The single-process state dict (global expert indices, whole tensors), assembled on every rank."""
    params = dict(model.named_parameters())
    state = {}
    for name, tensor in model.state_dict().items():
        param = params.get(name)
        if param is not None and tensor_parallel_dim(param) is not None and ctx.layout.tp > 1:
            tensor = _all_gather_cat(tensor, tensor_parallel_dim(param), ctx.tp_group)
        if param is not None and is_expert_parameter(param) and ctx.layout.ep > 1:
            tensor = _all_gather_cat(tensor, 0, ctx.ep_group)
        state[name] = tensor.clone()
    if ctx.layout.pp > 1:  # every stage holds other layers: merge them
        stages: list[dict] = [{} for _ in range(ctx.layout.pp)]
        dist.all_gather_object(stages, state, group=ctx.pp_group)
        state = {k: v for stage in stages for k, v in stage.items()}
    return state
