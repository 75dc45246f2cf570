"""This rank's training state under global, layout-independent keys, as DCP can reshard it.

Parameters keep their global names (global layer index; experts stacked along dim 0 with global
indices). A parameter sliced over tensor or expert parallelism becomes a DTensor sharded on a mesh
built from that megatron-core group; a replicated one stays a plain tensor (DCP keeps one copy).
Adam moments are stored per parameter, shaped and sharded like it: the ZeRO-1 buckets are
layout-specific, so at save each bucket's moments are all-gathered over its group and cut back into
parameters, and at load the new layout's buckets take their slices. The master copy is the
parameter itself (the optimizer copies it back every step), so it is not stored twice.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.optimizer import ShardedAdamW
from parallel.params import is_expert_parameter, tensor_parallel_dim
from parallel.state import ParallelContext

MOMENTS = ("exp_avg", "exp_avg_sq")


class GlobalState:
    def __init__(self, model: nn.Module, optimizer: ShardedAdamW, ctx: ParallelContext):
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        self._meshes: dict[int, DeviceMesh] = {}
        self.names = {id(p): name for name, p in model.named_parameters()}

    def _mesh(self, group: dist.ProcessGroup) -> DeviceMesh:
        key = id(group)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(group, self.ctx.device.type)
        return self._meshes[key]

    def _placement(self, param: nn.Parameter) -> tuple[dist.ProcessGroup, int] | None:
        if tensor_parallel_dim(param) is not None and self.ctx.layout.tp > 1:
            return self.ctx.tp_group, tensor_parallel_dim(param)
        if is_expert_parameter(param) and self.ctx.layout.ep > 1:
            return self.ctx.ep_group, 0
        return None

    def _wrap(self, param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        placement = self._placement(param)
        if placement is None:
            return local
        group, dim = placement
        shape = list(local.shape)
        shape[dim] *= dist.get_world_size(group)
        return DTensor.from_local(local, self._mesh(group), [Shard(dim)], shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to save (or to load into: same keys and shapes for this layout)."""
        state = {}
        for name, tensor in self.model.state_dict().items():
            state[f"model.{name}"] = tensor
        params = dict(self.model.named_parameters())
        for name, param in params.items():
            state[f"model.{name}"] = self._wrap(param, param.detach())
        for moment, per_param in self._moments().items():
            for param, tensor in per_param:
                state[f"optim.{moment}.{self.names[id(param)]}"] = self._wrap(param, tensor)
        return state

    def _moments(self) -> dict[str, list[tuple[nn.Parameter, torch.Tensor]]]:
        result = {m: [] for m in MOMENTS}
        for bucket in self.optimizer.buckets:
            adam = self.optimizer.adamw.state.get(bucket.shard, {})
            for moment in MOMENTS:
                shard = adam.get(moment, torch.zeros_like(bucket.shard))
                flat = bucket.gather(shard.detach())
                offset = 0
                for p in bucket.params:
                    result[moment].append((p, flat[offset:offset + p.numel()].view_as(p).clone()))
                    offset += p.numel()
        return result

    @torch.no_grad()
    def apply(self, loaded: dict[str, torch.Tensor], step: int) -> None:
        """Copy a loaded state_dict() into the model and rebuild the optimizer's buckets and moments."""

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        for name, tensor in self.model.state_dict().items():
            tensor.copy_(local(loaded[f"model.{name}"]))
        for bucket in self.optimizer.buckets:
            bucket.reload_from_parameters()
            state = {"step": torch.tensor(float(step), dtype=torch.float32)}
            for moment in MOMENTS:
                parts = [local(loaded[f"optim.{moment}.{self.names[id(p)]}"]).reshape(-1) for p in bucket.params]
                state[moment] = bucket.my_slice(torch.cat(parts)).clone()
            if step > 0:
                self.optimizer.adamw.state[bucket.shard] = state
