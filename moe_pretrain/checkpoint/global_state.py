"""This rank's training state under global, layout-independent keys, as DCP can reshard it.

Parameters keep their global names (global layer index; experts stacked along dim 0 with global
indices). A parameter sliced over tensor or expert parallelism becomes a DTensor sharded on a mesh
built from that megatron-core group; a replicated one stays a plain tensor (DCP keeps one copy).
Optimizer moments (AdamW's exp_avg / exp_avg_sq, Muon's momentum) are stored per parameter under the
parameter's global shape, but each rank saves only the flat range its ZeRO-1 slice holds, as boxes of the
global tensor (parallel/flat_shards.py): nothing is gathered or copied at save, and at load DCP fills each
new layout's boxes, in place, from whichever boxes were saved. The master copy is the parameter itself,
so it is not stored twice; a parameter held in bf16 (train.param_dtype) is saved as its fp32 masters, boxes
of each rank's slice as for the moments, so that a checkpoint holds fp32 values under either setting and loads
into the other.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.flat_shards import BoxedTensor
from parallel.optimizer import ShardedOptimizer
from parallel.plan import ShardingPlan
from parallel.state import ParallelContext


class GlobalState:
    def __init__(self, model: nn.Module, optimizer: ShardedOptimizer, ctx: ParallelContext, plan: ShardingPlan):
        self.model, self.optimizer, self.ctx, self.plan = model, optimizer, ctx, plan
        self._meshes: dict[int, DeviceMesh] = {}
        self.names = {id(p): name for name, p in model.named_parameters()}

    def _mesh(self, group: dist.ProcessGroup) -> DeviceMesh:
        key = id(group)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(group, self.ctx.device.type)
        return self._meshes[key]

    def _placement(self, name: str) -> tuple[dist.ProcessGroup, int] | None:
        placement = self.plan.placement(name)
        if placement.tensor_dim is not None and self.ctx.layout.tp > 1:
            return self.ctx.tp_group, placement.tensor_dim
        if placement.expert_dim is not None and self.ctx.layout.ep > 1:
            return self.ctx.ep_group, placement.expert_dim
        return None

    def _wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        placement = self._placement(name)
        if placement is None:
            return local
        group, dim = placement
        shape = self._global(name, tuple(local.shape))[0]
        return DTensor.from_local(local, self._mesh(group), [Shard(dim)], shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def _global(self, name: str, local: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, offsets of this rank's block) of the parameter `name` held here as `local`."""
        placement, layout = self.plan.placement(name), self.ctx.layout
        return (placement.global_shape(local, layout.tp, layout.ep),
                placement.local_offsets(local, self.ctx.tp_rank, self.ctx.ep_rank))

    def state_dict(self) -> dict[str, torch.Tensor | BoxedTensor]:
        """Tensors to save (or to load into, in place: same keys and global shapes for every layout)."""
        state = {}
        for name, tensor in self.model.state_dict().items():  # buffers; per-expert ones sharded like the experts
            state[f"model.{name}"] = self._wrap(name, tensor)
        held = {id(p): [f"optim.{moment}" for moment in self.optimizer.moments(bucket)]
                + (["model"] if bucket.master is not None else []) for bucket in self.optimizer.buckets
                for p in bucket.params}
        for name, param in self.model.named_parameters():
            state[f"model.{name}"] = self._wrap(name, param.detach())
            for prefix in held.get(id(param), ()):  # replaced below by the boxes this rank holds, if any
                state[f"{prefix}.{name}"] = BoxedTensor(torch.Size(self._global(name, param.shape)[0]), [])
        for bucket in self.optimizer.buckets:
            ranges = {f"optim.{moment}": flat for moment, flat in self.optimizer.moments(bucket).items()}
            if bucket.master is not None:  # the parameter's value is its master's, held as the moments are
                ranges["model"] = bucket.master
            for prefix, flat in ranges.items():
                for param, lo, hi, at in bucket.pieces():
                    name = self.names[id(param)]
                    global_shape, offsets = self._global(name, tuple(param.shape))
                    state[f"{prefix}.{name}"] = BoxedTensor.from_flat_range(
                        global_shape, tuple(param.shape), offsets, lo, flat[at:at + hi - lo])
        return state

    @torch.no_grad()
    def after_load(self, step: int) -> None:
        """The state was loaded in place: AdamW's step count is left to set, and the parameters held in bf16 to
        take their masters' values (collective)."""
        self.optimizer.set_step(step)
        self.optimizer.refresh_parameters()
