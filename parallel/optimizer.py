"""ZeRO-1: AdamW whose state each data-parallel rank keeps only for its slice of the parameters.

Parameters are flattened into buckets per (reduction group, weight decay, dtype), in model order,
each at most bucket_bytes. Per step and bucket: reduce-scatter the flat gradient over the bucket's
group (dense parameters over data parallel, expert parameters over expert-data parallel), so each rank
receives the summed gradient of its 1/size slice; clip all slices by the global norm; run AdamW on the
slice (its master copy and the Adam moments live only here); all-gather the updated slices back into
the parameters. With a group of one (a single process) the collectives vanish and this is AdamW.

Gradients are summed, not averaged: the trainer already divides every loss by the global token count.
The global norm counts every element once: within a group the slices are disjoint, dense parameters
are sliced over all ranks, and each expert's parameters over the ranks that hold that expert.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_reduce_sum, group_size
from parallel.torch_compat import all_gather_single, reduce_scatter_single


@dataclass
class ParamGroupSpec:
    """Parameters that reduce over one group and share one weight decay."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    weight_decay: float


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None):
        self.params = params
        self.group = group
        self.size = group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // self.size) * self.size
        self.shard_numel = self.padded // self.size
        self.shard = nn.Parameter(self.my_slice(torch.cat([p.detach().reshape(-1) for p in params])).clone())

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.padded - self.numel))

    def my_slice(self, flat_unpadded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat [numel] tensor laid out like the bucket."""
        start = self.rank * self.shard_numel
        return torch.nn.functional.pad(flat_unpadded, (0, self.padded - self.numel))[start:start + self.shard_numel]

    @torch.no_grad()
    def reload_from_parameters(self) -> None:
        """Reset the master slice from the parameters (after they were loaded)."""
        self.shard.copy_(self.my_slice(torch.cat([p.detach().reshape(-1) for p in self.params])))

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """All ranks' slices of a shard-shaped tensor, concatenated and unpadded: [numel]."""
        if self.size == 1:
            return shard[:self.numel]
        full = shard.new_empty(self.padded)
        all_gather_single(full, shard.contiguous(), group=self.group)
        return full[:self.numel]

    def reduce_scatter_gradient(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        if self.size == 1:
            self.shard.grad = flat
            return
        shard = flat.new_empty(self.shard_numel)
        reduce_scatter_single(shard, flat, group=self.group)
        self.shard.grad = shard

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        full = self.gather(self.shard.detach())
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class ShardedAdamW:
    def __init__(self, specs: list[ParamGroupSpec], *, lr: float, betas: tuple[float, float], eps: float,
                 bucket_bytes: int, norm_group: dist.ProcessGroup | None):
        self.norm_group = norm_group
        self.buckets: list[_Bucket] = []
        adam_groups = []
        for spec in specs:
            spec_buckets = self._bucketize(spec, bucket_bytes)
            self.buckets.extend(spec_buckets)
            if spec_buckets:
                adam_groups.append({"params": [b.shard for b in spec_buckets], "weight_decay": spec.weight_decay})
        self.adamw = torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps, fused=True)
        self._model_params = [p for b in self.buckets for p in b.params]

    @staticmethod
    def _bucketize(spec: ParamGroupSpec, bucket_bytes: int) -> list[_Bucket]:
        buckets, current, current_bytes = [], [], 0
        for p in spec.params:
            if current and (current_bytes + p.numel() * p.element_size() > bucket_bytes
                            or p.dtype != current[0].dtype):
                buckets.append(_Bucket(current, spec.group))
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current, spec.group))
        return buckets

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups

    def zero_grad(self) -> None:
        for p in self._model_params:
            p.grad = None

    def step(self, max_norm: float, skip: bool = False) -> float:
        """Reduce, clip to max_norm (<= 0: no clipping), update, gather. Returns the global gradient norm.

        A non-finite norm, or skip=True (the caller saw a non-finite loss), leaves the parameters and the
        Adam state untouched; every rank sees the same global norm, so all skip together."""
        for bucket in self.buckets:
            bucket.reduce_scatter_gradient()
        grads = [b.shard.grad for b in self.buckets]
        local = torch.stack([g.pow(2).sum() for g in grads]).sum()
        total_norm = float(all_reduce_sum(local, self.norm_group).sqrt())
        if skip or not math.isfinite(total_norm):
            return total_norm
        if max_norm > 0:
            coef = min(max_norm / (total_norm + 1e-6), 1.0)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self.adamw.step()
        for bucket in self.buckets:
            bucket.all_gather_parameters()
        return total_norm

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: master slices plus Adam moments."""
        total = sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)
        for state in self.adamw.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
        return total
