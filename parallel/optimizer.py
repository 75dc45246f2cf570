"""ZeRO-1: AdamW and Muon whose state each data-parallel rank keeps only for its slice of the parameters.

Parameters live in flat buckets per (reduction group, weight decay, dtype), in model order, each at most
bucket_bytes: a bucket owns one flat parameter buffer and one flat gradient buffer, and every parameter
and its .grad are views into them (Megatron's param-and-grad buffers), so nothing is stored twice. Each
rank's optimizer "master" slice is a view of its range of the parameter buffer (parameters are >= fp32:
bf16 training keeps fp32 parameters under autocast), and the Adam moments exist for that range only.
Per step and bucket: reduce-scatter the flat gradient over the bucket's group (dense parameters over data
parallel, expert parameters over expert-data parallel), so each rank receives the summed gradient of its
1/size slice; clip all slices by the global norm; run AdamW on the slice in place; all-gather the slices
back into the parameter buffer. With a group of one (a single process) the collectives vanish and this is
AdamW on the parameters themselves.

Muon (optim.name=muon) takes the matrices: a group whose spec lists MatrixSpecs keeps one momentum per slice
instead of Adam's two moments, and its buckets' updates come from whole matrices, orthogonalised on one owner
rank each (parallel/muon.py); the gradients' reduce-scatter and the parameters' all-gather are the same.

The reduce-scatters overlap the backward (megatron-core's overlap_grad_reduce): zero_grad(backwards=M) arms
each bucket with the number of gradient accumulations the step will make into it (M micro-batches times
its parameters; post-accumulate-grad hooks count them down), and a bucket whose count reaches zero starts
its reduce-scatter asynchronously while the backward goes on to earlier layers. Buckets start strictly in
one fixed order (the order the backward completes them: the bucket of the latest parameters first), the
same on every rank, so every group's collectives match across its ranks even if a bucket is not complete
when a later one is (one waits for the other). reduce_gradients() starts whatever has not started (a
bucket with a parameter that received no gradient this step) and waits for all. A parameter accumulating
after its bucket started is an error, not a silent wrong sum.

The all-gathers overlap the next forward (megatron-core's overlap_param_gather): update() starts every
bucket's all-gather in model order and returns; gate_parameter_use(units) makes each unit (a decoder layer,
the embeddings, the head: modules whose forward is the only reader of their parameters) wait, in a forward
pre-hook, for the buckets holding its parameters, so the first layers compute while the later layers'
parameters arrive. Anything else that reads parameters must call finish_parameter_gathers() first; the
model's state_dict (saves, exports) does so by a hook.

Parameters may be held in a lower dtype than they were built in (train.param_dtype=bfloat16: the matmuls'
weights, megatron-core's bf16 parameters): their buckets' flat buffer is bf16, each rank's range keeps an fp32
master (the shard AdamW and Muon step on), and the all-gather sends the master rounded to bf16. Their
gradient buffer is fp32 by default (megatron-core's main_grad: each backward's bf16 .grad is added into it by
the post-accumulate hook and dropped) or bf16 (held_grad_dtype; autograd accumulates into it directly); the
reduced slice is cast to the master's dtype for the update. Held in fp32 throughout, nothing changes.

Gradients are summed, not averaged: the trainer already divides every loss by the global token count.
The global norm counts every element once: within a group the slices are disjoint, dense parameters
are sliced over all ranks, and each expert's parameters over the ranks that hold that expert.
"""

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_gather_into_async, all_reduce_sum, group_size, reduce_scatter_into_async
from parallel.flat_shards import flat_range_boxes
from parallel.muon import MatrixSpec, MuonExchange


@dataclass
class ParamGroupSpec:
    """Parameters that reduce over one group and share one weight decay and learning-rate scale."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    weight_decay: float
    lr_scale: float = 1.0
    """This group's learning rate is the schedule's times lr_scale (set_lr)..."""
    warmup_steps: int = 0
    """... times min(1, (step + 1) / warmup_steps): a ramp of its own (0: none)."""
    matrices: list[MatrixSpec] | None = None
    """Muon's view of each parameter (a Muon group); None: an AdamW group."""


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 held: torch.dtype | None = None, grad_dtype: torch.dtype | None = None):
        """held: the dtype the parameters are held in from now on (None: their own); below their own, this rank's
        range keeps a master in their own dtype. grad_dtype: the gradient buffer's (None: their own)."""
        self.params = params
        self.group = group
        self.size = group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // self.size) * self.size
        self.shard_numel = self.padded // self.size
        self.start = self.rank * self.shard_numel
        """This rank's range of the flat buffer: [start, start + shard_numel) (the tail may be padding)."""
        like = params[0]
        self.data = torch.zeros(self.padded, dtype=held or like.dtype, device=like.device)
        self.grad_dtype = grad_dtype or like.dtype
        self.grad_data: torch.Tensor | None = None
        """Allocated by the first zero_grad (a state only loaded and saved, by tools, never has one)."""
        self.master: torch.Tensor | None = None
        """This rank's range in the parameters' own dtype, where they are held in a lower one (None: the range
        of data is the master)."""
        self.offsets = list(itertools.accumulate((p.numel() for p in params[:-1]), initial=0))
        with torch.no_grad():
            if self.data.dtype != like.dtype:  # this rank's range of the values as built, before they are rounded
                self.master = torch.zeros(self.shard_numel, dtype=like.dtype, device=like.device)
                for p, lo, hi, at in self.pieces():
                    self.master[at:at + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
            for p, offset in zip(params, self.offsets):
                self.data[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.data[offset:offset + p.numel()].view_as(p)
        self.shard = nn.Parameter(self.master if self.master is not None
                                  else self.data[self.start:self.start + self.shard_numel])
        self.remaining: int | None = None
        """Gradient accumulations still to come this step before the reduce-scatter may start (None: not
        armed, so it starts in reduce_gradients)."""
        self.work: dist.Work | None = None
        self.started = False
        self.reduced: torch.Tensor | None = None
        """The slice's summed gradient in the buffer's dtype, from the reduce-scatter under way."""
        self.gathering: tuple[dist.Work, torch.Tensor] | None = None
        """The parameters' all-gather under way, and the shard copy it sends."""
        self.exchange: MuonExchange | None = None
        """A Muon bucket's exchange of whole matrices (None: an AdamW bucket)."""
        self.momentum: torch.Tensor | None = None
        """A Muon bucket's momentum of this rank's range, [shard_numel]."""

    def attach_gradients(self) -> None:
        """Point every parameter's .grad at its view of the zeroed gradient buffer (autograd accumulates
        into an existing .grad in place). A buffer in another dtype than the parameters' cannot be their .grad:
        each backward's .grad is added into it by accumulate(), then dropped."""
        if self.grad_data is None:
            self.grad_data = torch.zeros_like(self.data, dtype=self.grad_dtype)
        self.grad_data.zero_()
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.grad_data[offset:offset + p.numel()].view_as(p) if self.grad_dtype == p.dtype else None

    @torch.no_grad()
    def accumulate(self, index: int) -> None:
        """Parameter `index` has its gradient of one backward: into a buffer of another dtype, add and drop it
        (megatron-core's main_grad; the buffer of the parameters' own dtype is their .grad already)."""
        p = self.params[index]
        if self.grad_dtype != p.dtype and p.grad is not None:
            self.grad_data[self.offsets[index]:self.offsets[index] + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None

    @property
    def ready(self) -> bool:
        return self.remaining == 0

    def start_reduce_scatter(self) -> None:
        """Start the gradient's reduce-scatter (asynchronously; finish_reduce_scatter waits)."""
        if self.grad_data is None:
            raise RuntimeError("ShardedOptimizer.step before any zero_grad(): call zero_grad() before the first "
                               "backward, so gradients accumulate into the optimizer's buffers")
        self.started = True
        if self.size == 1:
            self.reduced = self.grad_data
            return
        self.reduced = self.grad_data.new_empty(self.shard_numel)
        self.work = reduce_scatter_into_async(self.reduced, self.grad_data, self.group)

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; the slice's gradient, in the master's dtype, is then shard.grad."""
        if not self.started:
            self.start_reduce_scatter()
        if self.work is not None:
            self.work.wait()
        self.shard.grad = self.reduced.to(self.shard.dtype)
        self.work, self.started, self.remaining, self.reduced = None, False, None, None

    @torch.no_grad()
    def start_all_gather(self) -> None:
        """Start gathering every rank's updated shard into the parameter buffer (finish_all_gather waits)."""
        if self.size > 1:
            source = self.shard.detach().to(self.data.dtype, copy=True)
            self.gathering = (all_gather_into_async(self.data, source, self.group), source)
        elif self.master is not None:
            self.data.copy_(self.master)

    def finish_all_gather(self) -> None:
        if self.gathering is not None:
            self.gathering[0].wait()
            self.gathering = None

    def pieces(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """(parameter, its first and end element in this rank's range, where that part starts in the range)
        for each parameter this rank's range touches, in flat order."""
        result = []
        end = min(self.start + self.shard_numel, self.numel)
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(self.start, offset), min(end, offset + p.numel())
            if lo < hi:
                result.append((p, lo - offset, hi - offset, lo - self.start))
        return result


class ShardedOptimizer:
    def __init__(self, specs: list[ParamGroupSpec], *, lr: float, betas: tuple[float, float], eps: float,
                 bucket_bytes: int, norm_group: dist.ProcessGroup | None,
                 param_order: list[nn.Parameter] | None = None, momentum: float = 0.95,
                 tp_group: dist.ProcessGroup | None = None, held_in: dict[int, torch.dtype] | None = None,
                 held_grad_dtype: torch.dtype | None = None):
        """param_order: every parameter in model order (forward order), which sets the order the buckets'
        reduce-scatters start in (reverse); default: the specs' order. momentum: Muon's (Nesterov). tp_group:
        the tensor-parallel group whose slices a MatrixSpec with a tensor_dim joins. held_in: parameters (by id)
        held in a lower dtype than their own from now on, their own kept as the master of each rank's slice
        (train.param_dtype); held_grad_dtype: their gradient buffers' dtype (None: their own)."""
        self.norm_group = norm_group
        self.held_in = held_in or {}
        self.held_grad_dtype = held_grad_dtype
        self.momentum = momentum
        self.buckets: list[_Bucket] = []
        adam_groups, self.muon_groups = [], []
        loads: dict[int, list[int]] = {}
        """Per reduction group, each rank's Newton-Schulz work so far: owners balance across its buckets."""
        for spec in specs:
            spec_buckets = self._bucketize(spec, bucket_bytes)
            self.buckets.extend(spec_buckets)
            if not spec_buckets:
                continue
            settings = {"lr": lr, "weight_decay": spec.weight_decay, "lr_scale": spec.lr_scale,
                        "warmup_steps": spec.warmup_steps}
            if spec.matrices is None:
                adam_groups.append({"params": [b.shard for b in spec_buckets], **settings})
                continue
            matrix_of = {id(p): m for p, m in zip(spec.params, spec.matrices, strict=True)}
            group_loads = loads.setdefault(id(spec.group), [0] * group_size(spec.group))
            for bucket in spec_buckets:
                bucket.exchange = MuonExchange([matrix_of[id(p)] for p in bucket.params], bucket.offsets,
                                               bucket.numel, bucket.shard_numel, spec.group, group_loads, tp_group)
                bucket.momentum = torch.zeros_like(bucket.shard)
            self.muon_groups.append({"buckets": spec_buckets, **settings})
        self.adamw = torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps, fused=True) if adam_groups else None
        # The backward completes the buckets of the model's later parameters first: start those first.
        position = {id(p): i for i, p in enumerate(param_order or [p for b in self.buckets for p in b.params])}
        self.start_order = sorted(self.buckets, key=lambda b: -min(position[id(p)] for p in b.params))
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        """Each parameter's bucket, by id."""
        self._next_to_start = 0
        self._gated = False
        for bucket in self.buckets:
            for index, param in enumerate(bucket.params):
                param.register_post_accumulate_grad_hook(
                    lambda _, bucket=bucket, index=index: self._accumulated(bucket, index))
        for bucket in self.buckets:
            if bucket.exchange is None:
                # Created now (AdamW would at its first step) so a checkpoint can load into them in place.
                self.adamw.state[bucket.shard] = {
                    "step": torch.zeros((), dtype=torch.float32, device=bucket.shard.device),
                    "exp_avg": torch.zeros_like(bucket.shard), "exp_avg_sq": torch.zeros_like(bucket.shard)}

    def _bucketize(self, spec: ParamGroupSpec, bucket_bytes: int) -> list[_Bucket]:
        """The spec's parameters in buckets of at most bucket_bytes as held, one held dtype each: those held in a
        lower dtype first, then the rest, each in the spec's order."""
        buckets = []
        low = [p for p in spec.params if id(p) in self.held_in]
        for params in (low, [p for p in spec.params if id(p) not in self.held_in]):
            current, current_bytes = [], 0
            for p in params:
                held = self.held_in.get(id(p), p.dtype)
                size = p.numel() * held.itemsize
                if current and (current_bytes + size > bucket_bytes or p.dtype != current[0].dtype):
                    buckets.append(self._bucket(current, spec.group))
                    current, current_bytes = [], 0
                current.append(p)
                current_bytes += size
            if current:
                buckets.append(self._bucket(current, spec.group))
        return buckets

    def _bucket(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> _Bucket:
        held = self.held_in.get(id(params[0]))
        return _Bucket(params, group, held, self.held_grad_dtype if held is not None else None)

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's groups, then Muon's (each a dict with its lr, weight_decay, lr_scale, warmup_steps)."""
        return (self.adamw.param_groups if self.adamw is not None else []) + self.muon_groups

    def set_lr(self, lr: float, step: int = 0) -> None:
        """The schedule's learning rate for 0-based optimizer step `step`, times each group's lr_scale and
        its own warmup ramp."""
        for group in self.param_groups:
            ramp = min(1.0, (step + 1) / group["warmup_steps"]) if group["warmup_steps"] else 1.0
            group["lr"] = lr * group["lr_scale"] * ramp

    def zero_grad(self, backwards: int | None = None) -> None:
        """Zero the gradient buffers. backwards: the backward passes this step makes (its micro-batches),
        each accumulating once into every parameter: the buckets then start their reduce-scatters during
        the last one. None: they all start in reduce_gradients (a caller that counts nothing)."""
        for bucket in self.buckets:
            if bucket.work is not None:  # a step abandoned mid-way: nothing may still read the buffer
                bucket.work.wait()
            bucket.work, bucket.started, bucket.reduced = None, False, None
            bucket.attach_gradients()
            bucket.remaining = None if backwards is None else backwards * len(bucket.params)
        self._next_to_start = 0

    def _accumulated(self, bucket: _Bucket, index: int) -> None:
        """Parameter `index` of the bucket has its gradient of one backward (autograd's hook)."""
        bucket.accumulate(index)
        if bucket.remaining is None:
            return
        if bucket.started:
            raise RuntimeError("a gradient was accumulated into a bucket whose reduce-scatter had started: "
                               "zero_grad(backwards=) was given fewer backward passes than the step made")
        bucket.remaining -= 1
        while self._next_to_start < len(self.start_order) and self.start_order[self._next_to_start].ready:
            self.start_order[self._next_to_start].start_reduce_scatter()
            self._next_to_start += 1

    def reduce_gradients(self) -> torch.Tensor:
        """Finish every bucket's reduce-scatter (starting those the backward did not); returns the global
        gradient norm, still on the device (the caller reads it with the step's other scalars, once)."""
        for bucket in self.start_order:
            bucket.finish_reduce_scatter()
        self._next_to_start = 0
        grads = [b.shard.grad for b in self.buckets]
        local = torch.stack(torch._foreach_norm(grads, 2)).pow(2).sum()  # no squared copy of any gradient
        return all_reduce_sum(local, self.norm_group).sqrt()

    def update(self, max_norm: float, total_norm: float) -> None:
        """Clip the reduced gradients to max_norm (<= 0: no clipping) by their global norm (every rank has
        the same), run AdamW and Muon on this rank's slices, start gathering the parameters (finished here unless
        gate_parameter_use made the next forward wait for them). A caller that skips a step
        (non-finite loss or norm) does not call this: parameters and Adam state stay untouched."""
        if not math.isfinite(total_norm):
            raise ValueError(f"ShardedOptimizer.update with a non-finite gradient norm {total_norm}: skip the step")
        if max_norm > 0:
            coef = min(max_norm / (total_norm + 1e-6), 1.0)
            if coef < 1.0:
                torch._foreach_mul_([b.shard.grad for b in self.buckets], coef)
        if self.adamw is not None:
            self.adamw.step()
        self._muon_step()
        for bucket in reversed(self.start_order):  # model order: the first layers' parameters first
            bucket.start_all_gather()
        if not self._gated:
            self.finish_parameter_gathers()

    @torch.no_grad()
    def _muon_step(self) -> None:
        """Muon on this rank's slices: momentum <- mu momentum + g, the Nesterov direction g + mu momentum
        orthogonalised as whole matrices (parallel/muon.py), decoupled weight decay as AdamW's."""
        for group in self.muon_groups:
            for bucket in group["buckets"]:
                grad = bucket.shard.grad
                bucket.momentum.mul_(self.momentum).add_(grad)
                update = bucket.exchange.update(grad.add(bucket.momentum, alpha=self.momentum))
                bucket.shard.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])

    @torch.no_grad()
    def scale_rows(self, param: nn.Parameter, factor: torch.Tensor) -> None:
        """Row i of param (its first dimension) times factor[i], on every rank holding param alike, and in its
        master slice too where it is held in a lower dtype: an edit outside the optimizer (QK-clip) that the
        next update and gather keep. The slice's part of param is cut into boxes (flat_range_boxes), each
        scaled in place: no tensor of param's size is made."""
        rows = param.view(param.shape[0], -1)
        rows.mul_(factor[:, None])
        bucket = self.bucket_of[id(param)]
        if bucket.master is None:
            return
        for p, lo, hi, at in bucket.pieces():
            if p is not param:
                continue
            for (row, _), (height, width) in flat_range_boxes(tuple(rows.shape), lo, hi):
                bucket.master[at:at + height * width].view(height, width).mul_(factor[row:row + height, None])
                at += height * width

    def refresh_parameters(self) -> None:
        """Set the parameters held in a lower dtype from their masters, after the masters were loaded in place
        (collective over each such bucket's group)."""
        for bucket in self.buckets:
            if bucket.master is not None:
                bucket.start_all_gather()
        self.finish_parameter_gathers()

    def finish_parameter_gathers(self) -> None:
        """Wait until every parameter holds its updated value on this rank."""
        for bucket in self.buckets:
            bucket.finish_all_gather()

    def gate_parameter_use(self, root: nn.Module, units: list[nn.Module]) -> None:
        """Let the parameter all-gathers run into the next forward: each unit waits, before its forward, for
        the buckets holding its parameters; root's state_dict waits for all. Every parameter must be in some
        unit, and a unit's forward must be the only reader of its parameters (module docstring)."""
        bucket_of = self.bucket_of
        covered = set()
        for unit in units:
            buckets = list({id(bucket_of[id(p)]): bucket_of[id(p)] for p in unit.parameters()
                            if id(p) in bucket_of}.values())
            covered.update(id(p) for p in unit.parameters())
            unit.register_forward_pre_hook(_waiting_for(buckets))
        if missing := [name for name, p in root.named_parameters() if id(p) in bucket_of and id(p) not in covered]:
            raise ValueError(f"gate_parameter_use: parameters in no unit would be read before they arrive: {missing}")
        root.register_state_dict_pre_hook(lambda *_: self.finish_parameter_gathers())
        self._gated = True

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (the buckets' flat buffers, which the parameters view)."""
        return sum(b.data.numel() * b.data.element_size() for b in self.buckets)

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradient buffers (allocated at the first step)."""
        return sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buckets if b.grad_data is not None)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the Adam moments and Muon momenta of its slices, and the masters
        of the slices held in a lower dtype (elsewhere the master slice is a view of the parameters)."""
        masters = [b.master for b in self.buckets if b.master is not None]
        return sum(t.numel() * t.element_size()
                   for t in [*masters, *(t for bucket in self.buckets for t in self.moments(bucket).values())])

    def exchange_bytes(self) -> int:
        """Bytes this rank's Muon exchanges send to other ranks per step (0 without Muon)."""
        return sum(b.exchange.sent_elements * b.shard.element_size() for b in self.buckets if b.exchange is not None)

    def moments(self, bucket: "_Bucket") -> dict[str, torch.Tensor]:
        """This rank's slices of a bucket's optimizer state, [shard_numel] each: AdamW's "exp_avg" and
        "exp_avg_sq", or Muon's "momentum"."""
        if bucket.momentum is not None:
            return {"momentum": bucket.momentum}
        state = self.adamw.state[bucket.shard]
        return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}

    @torch.no_grad()
    def set_step(self, step: int) -> None:
        """The Adam step count (bias correction) after loading a checkpoint of `step` optimizer steps."""
        for state in (self.adamw.state.values() if self.adamw is not None else ()):
            state["step"].fill_(step)


def _waiting_for(buckets: list[_Bucket]):
    """A forward pre-hook that waits for these buckets' all-gathers."""
    def hook(_module: nn.Module, _args: tuple) -> None:
        for bucket in buckets:
            bucket.finish_all_gather()
    return hook
