"""Build this rank's part of the model: on the meta device, placed by the sharding plan, then materialised.

1. The whole model is constructed on the meta device (no memory, seconds even at full size), and every
   parameter's global shape and declared initialisation are recorded under its global name.
2. parallel/plan.py's placements shrink each sharded parameter to this rank's shape (still meta), and the
   modules that communicate are swapped: column / row projections, the vocab-parallel embedding, the
   all-to-all expert dispatcher, balancing statistics over the tensor x data group. The activation plan
   (parallel/activation_plan.py) places the sequence: its split over context- and sequence-parallel ranks.
3. A pipeline rank keeps its chunks' layers (and the embeddings / head when it holds the first / last).
4. Only then is anything allocated: each kept parameter directly on the device in its dtype, filled with
   exactly its slice of the layout-independent initial values (moe_pretrain/model/init.py), in slabs
   along dimension 0 so the float64 draw never exceeds a few MB beyond the parameter itself.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gpu_kernels.choice import Kernels
from gpu_kernels.fast_paths import resolve as resolve_kernels
from moe_pretrain.config import Config, ConfigError
from moe_pretrain.config.stage import mla_exchange
from moe_pretrain.dtypes import DTYPES, parameter_dtype
from moe_pretrain.model import MoETransformer
from moe_pretrain.model.init import Init, draw, parameter_inits
from moe_pretrain.model.meta import meta_model
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher
from moe_pretrain.ops.host_values import HostValues
from parallel.activation_plan import apply_activation_plan, splits_of
from parallel.all_to_all_dispatch import AllToAllTokenDispatcher
from parallel.collectives import all_gather_stacked, gather_objects
from parallel.node_dispatch import NodeTokenDispatcher
from parallel.plan import ShardingPlan, Style, chunks_of_rank, pipeline_chunks
from parallel.state import ParallelContext
from parallel.statistics import GroupStatistics
from parallel.tensor_parallel import ColumnParallelLinear, InputGather, RowParallelLinear, vocab_parallel_embedding

SLAB_ELEMENTS = 1 << 22
"""Elements drawn at a time when materialising (float64: 32 MB)."""
@dataclass(frozen=True)
class GlobalParameter:
    shape: tuple[int, ...]
    init: Init


def describe_parameters(model: nn.Module) -> dict[str, GlobalParameter]:
    """Every parameter's global shape and initialisation (call before sharding)."""
    inits = parameter_inits(model)
    return {name: GlobalParameter(tuple(p.shape), inits[name]) for name, p in model.named_parameters()}


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)


def shard_parameters(model: nn.Module, plan: ShardingPlan, ctx: ParallelContext, mla: str = "ulysses") -> None:
    """Every sharded parameter becomes this rank's (meta) shard; communicating modules are swapped in.
    mla: MLA's exchange under context parallelism (resolved: config/stage.mla_exchange)."""
    layout = ctx.layout
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    problems = plan.check_divisible(shapes, layout.tp, layout.ep)
    if problems:
        raise ConfigError("invalid parallel layout for this model: " + "; ".join(problems))
    for name, shape in shapes.items():
        local = plan.placement(name).local_shape(shape, layout.tp, layout.ep)
        if local != shape:
            _set_parameter(model, name, torch.empty(local, device="meta"))
    for name, buffer in list(model.named_buffers()):  # per-expert state (FP8 amax histories) goes with its experts
        local = plan.placement(name).local_shape(tuple(buffer.shape), layout.tp, layout.ep)
        if local != tuple(buffer.shape):
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._buffers[leaf] = torch.empty(local, dtype=buffer.dtype, device="meta")
    if layout.tp > 1:
        gather = InputGather(ctx.tp_group)
        for path, module in list(model.named_modules()):
            style = plan.style(path)
            if style in (Style.COLUMN, Style.ROW) and isinstance(module, nn.Linear):
                parallel = ColumnParallelLinear(module, ctx.tp_group, gather) if style == Style.COLUMN \
                    else RowParallelLinear(module, ctx.tp_group)
            elif style == Style.VOCAB and isinstance(module, nn.Embedding):
                parallel = vocab_parallel_embedding(module, ctx.tp_group)
            else:
                continue
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, parallel)
    apply_activation_plan(model, splits_of(ctx, layout.cp, mla))
    for module in model.modules():
        if isinstance(module, LatentMoE) and layout.ep > 1:
            module.dispatcher = expert_dispatcher(module.cfg.num_experts, ctx, fused=module.dispatcher.fused,
                                                  host=module.router.host)
    if ctx.distributed:
        for router in model.routers().values():
            router.balancer.stats = GroupStatistics(ctx.tp_dp_group)


def expert_dispatcher(num_experts: int, ctx: ParallelContext, *, fused: bool, host: HostValues
                      ) -> LocalTokenDispatcher:
    """The expert-parallel dispatcher parallel.expert_dispatch names (flat, or by node), its rows in FP8 with
    parallel.dispatch_fp8, its tokens in parallel.dispatch_chunks chunks, its split sizes read by `host` (the
    model's: ops/host_values.py)."""
    options = dict(fused=fused, fp8=ctx.dispatch_fp8, chunks=ctx.dispatch_chunks, host=host)
    if ctx.expert_dispatch == "node":
        return NodeTokenDispatcher(num_experts, ctx.ep_rank, ctx.ep_rail_group, ctx.ep_node_group, **options)
    return AllToAllTokenDispatcher(num_experts, ctx.ep_group, ctx.ep_rank, **options)


def keep_pipeline_stage(model: MoETransformer, cfg: Config, ctx: ParallelContext) -> MoETransformer:
    """This pipeline rank's chunks (interleaved: chunks r, r + pp, ...) under their global names."""
    chunks = pipeline_chunks(cfg)
    mine = chunks_of_rank(len(chunks), ctx.layout.pp, ctx.pp_rank)
    return MoETransformer.stage_of(model, [i for c in mine for i in chunks[c]], first=0 in mine,
                                   last=len(chunks) - 1 in mine)


@torch.no_grad()
def materialize(model: nn.Module, parameters: dict[str, GlobalParameter], plan: ShardingPlan,
                ctx: ParallelContext, seed: int, dtype: torch.dtype, *, draw_values: bool = True) -> None:
    """Allocate every (meta) parameter of `model` on ctx.device in `dtype`, holding its slice of the initial
    values (or left empty with draw_values=False, for a state about to be loaded); buffers start at zero."""
    layout = ctx.layout
    for name, param in list(model.named_parameters()):
        spec = parameters[name]
        placement = plan.placement(name)
        local = tuple(param.shape)
        if local != placement.local_shape(spec.shape, layout.tp, layout.ep):
            raise RuntimeError(f"{name}: local shape {local} does not follow the plan for {spec.shape}")
        tensor = torch.empty(local, dtype=dtype, device=ctx.device)
        if draw_values and tensor.numel():
            offsets = placement.local_offsets(local, ctx.tp_rank, ctx.ep_rank)
            rows = max(1, SLAB_ELEMENTS // max(1, math.prod(local[1:])))
            for start in range(0, local[0], rows):
                count = min(rows, local[0] - start)
                values = draw(spec.init, seed, name, spec.shape, (offsets[0] + start, *offsets[1:]),
                              (count, *local[1:]))
                tensor[start:start + count] = values.to(dtype)
        _set_parameter(model, name, tensor)
    for module in model.modules():
        for leaf, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[leaf] = torch.zeros(buffer.shape, dtype=kind, device=ctx.device)


def build_model(cfg: Config, ctx: ParallelContext | None = None, plan: ShardingPlan | None = None, *,
                draw_values: bool = True, kernels: Kernels | None = None) -> MoETransformer:
    """This rank's part of the model, materialised: the whole model on one process, else its tensor /
    expert shards of its pipeline stage's layers. Initial values never depend on the layout. kernels: what
    the modules run (None: the config's kernels and precision sections resolved for ctx.device, a
    ConfigError where a forced choice cannot run there)."""
    ctx = ctx or ParallelContext.single()
    plan = plan or ShardingPlan()
    if kernels is None:
        kernels = resolve_kernels(cfg, ctx.device, DTYPES[cfg.train.dtype])
    model = meta_model(cfg.model, kernels)
    parameters = describe_parameters(model)
    if unplanned := plan.unplanned(list(parameters)):
        raise RuntimeError(f"parameters the sharding plan neither places nor declares replicated "
                           f"(parallel/plan.py model_plan / replicated_modules): {', '.join(unplanned[:8])}")
    shard_parameters(model, plan, ctx, mla_exchange(cfg.parallel.cp_mla, ctx.layout.cp,
                                                    cfg.model.mla.num_heads // ctx.layout.tp))
    if ctx.layout.pp > 1:
        model = keep_pipeline_stage(model, cfg, ctx)
    materialize(model, parameters, plan, ctx, cfg.train.seed, parameter_dtype(cfg.train.dtype), draw_values=draw_values)
    return model


def _all_gather_cat(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.cat(all_gather_stacked(tensor.contiguous(), group).unbind(0), dim=dim)


@torch.no_grad()
def gather_full_state(model: nn.Module, ctx: ParallelContext, plan: ShardingPlan | None = None
                      ) -> dict[str, torch.Tensor]:
    """The single-process state dict (global expert indices, whole tensors), assembled on every rank
    (for tests and small models: it holds the whole model)."""
    plan = plan or ShardingPlan()
    state = {}
    for name, tensor in model.state_dict().items():
        placement = plan.placement(name)
        if placement.tensor_dim is not None and ctx.layout.tp > 1:
            tensor = _all_gather_cat(tensor, placement.tensor_dim, ctx.tp_group)
        if placement.expert_dim is not None and ctx.layout.ep > 1:
            tensor = _all_gather_cat(tensor, placement.expert_dim, ctx.ep_group)
        state[name] = tensor.clone()
    if ctx.layout.pp > 1:  # every stage holds other layers: merge them (on the host: a pickled CUDA tensor
        # would unpickle onto the sender's GPU number)
        stages = gather_objects({k: v.cpu() for k, v in state.items()}, ctx.pp_group)
        state = {k: v.to(ctx.device) for stage in stages for k, v in stage.items()}
    return state
