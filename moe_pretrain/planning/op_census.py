"""The FLOPs and kernel launches of the aten ops a piece of code runs (the dry run's meter, and a real run's).

FLOPs come from torch's formulas (torch.utils.flop_counter's registry: matrix products, convolutions,
scaled products, flash and flex attention) and ours for what it lacks (the experts' grouped products, SDPA's
CPU kernel),
evaluated on each op's shapes, so fake tensors count as real ones do. FlopCounterMode itself is not used:
its module tracker hooks every module's forward and fails on modules called inside an autograd.Function's
forward (MLA's latent exchange expands keys so), and it decomposes ops it has no formula for, which changes
the ops other meters see. A launch is an op that computes: neither a view, nor an allocation, nor a query
of metadata; its bytes are those of its tensor arguments and results, and on a target GPU its time is its
roofline bound (planning/step_time.py) and, with a calibration table, its estimate
(planning/kernel_estimate.py). Ops a process-group backend runs for a collective (gloo's copies:
parallel/collectives.backend_ops) are its own, not counted. Counts are exact and the same on every machine.
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from gpu_kernels.launch_profile import PROFILES
from moe_pretrain.gpus import GpuSpec
from moe_pretrain.planning.calibration import Calibration
from moe_pretrain.planning.compute_sites import ComputeSites
from moe_pretrain.planning.kernel_estimate import launch_seconds
from moe_pretrain.planning.timeline import Timeline
from moe_pretrain.step_reuse import repeats_per_micro_batch
from parallel.collectives import inside_backend


def tensor_bytes(values) -> int:
    """Bytes of the tensors anywhere in `values` (nested tuples, lists, dicts)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> int:
    """torch._grouped_mm (the experts' products, forward and backward): every element of `a` meets one row of
    the right-hand side, whatever the grouping (2-D x 3-D, 2-D x 2-D into 3-D, or batched)."""
    return 2 * a.numel() * b.shape[-1]


def _cpu_attention_flops(query, key, value, dropout_p=0.0, is_causal=False, **kwargs) -> int:
    """SDPA's CPU kernel (the per-document reference MLA and the vision tower take off a GPU), which torch's
    registry lacks: its formula for the other SDPA kernels, halved when causal (the masked half is skipped,
    as the causal GPU kernels skip it; the plan counts causal attention so)."""
    flops = sdpa_flop_count(query.shape, key.shape, value.shape)
    return flops // 2 if is_causal else flops


def _cpu_attention_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False,
                                  **kwargs) -> int:
    flops = sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    return flops // 2 if is_causal else flops


EXTRA_FORMULAS = {
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}
"""FLOP formulas torch's registry lacks, on the op's arguments."""

LAUNCHING_NAMESPACES = ("aten", "moe_pretrain")
"""torch's ops and our GPU kernels' custom ops (gpu_kernels/: one launch each, seen whole, fake or real, unless
gpu_kernels/launch_profile.py lists the kernels an op stands for)."""
_NOT_LAUNCHES = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
                           "lift_fresh", "_local_scalar_dense", "set_", "alias", "_to_copy_meta", "_unsafe_view",
                           "_reshape_alias"})
"""Ops that launch no kernel: allocations, metadata, and views the schema does not mark as views
(`_unsafe_view`, reshape's result on a contiguous tensor)."""


class OpCensus(TorchDispatchMode):
    """with OpCensus() as ops: ... ; ops.flops, ops.launches, and each by aten op name (Counters)."""

    def __init__(self, gpu: GpuSpec | None = None, timeline: Timeline | None = None,
                 sites: ComputeSites | None = None, calibration: Calibration | None = None,
                 estimate: Timeline | None = None):
        """gpu: the target whose roofline bounds each launch's time (roofline_s), each told to `timeline` and filed
        by `sites` under the line that made it; calibration: the table that estimates it too (estimate_s), told to
        `estimate`."""
        super().__init__()
        self.gpu = gpu
        self.timeline = timeline
        self.sites = sites
        self.calibration = calibration
        self.estimate = estimate
        self.roofline_s = 0.0
        self.once_s = 0.0
        """Of roofline_s, the launches done once a step whatever its micro-batches
        (step_reuse.repeats_per_micro_batch)."""
        self.estimate_s = 0.0
        self.estimate_once_s = 0.0
        self.bytes_moved = 0
        """Bytes the launches read and write (their tensor arguments and results)."""
        self.flops = 0
        self.launches = 0
        self.flops_by_op: collections.Counter = collections.Counter()
        self.launches_by_op: collections.Counter = collections.Counter()
        self.bytes_by_op: collections.Counter = collections.Counter()

    def _flops(self, func, args: tuple, kwargs: dict, out) -> int:
        packet = func._overloadpacket
        if packet in EXTRA_FORMULAS:
            return EXTRA_FORMULAS[packet](*args, **kwargs)
        if packet in flop_registry:
            return flop_registry[packet](*args, **kwargs, out_val=out)
        return 0

    def _launched(self, name: str, flops: int, in_bytes: int, out_bytes: int, args: tuple = (),
                  kwargs: dict | None = None, kernel: bool = False) -> None:
        """One kernel: its FLOPs, bytes and (on a target GPU) its roofline time and estimate, told to the
        timelines and sites. kernel: a Triton kernel (ours, fla's), not an aten op."""
        moved = in_bytes + out_bytes
        self.launches += 1
        self.launches_by_op[name] += 1
        self.bytes_moved += moved
        self.bytes_by_op[name] += moved
        if flops:
            self.flops += flops
            self.flops_by_op[name] += flops
        if self.gpu is None:
            return
        seconds = max(flops / self.gpu.peak_flops, moved / self.gpu.memory_bytes_s)
        estimate = 0.0
        if self.calibration is not None:
            estimate = launch_seconds(self.calibration, name, flops, in_bytes, out_bytes, args, kwargs, kernel)
        self.roofline_s += seconds
        self.estimate_s += estimate
        if not repeats_per_micro_batch():
            self.once_s += seconds
            self.estimate_once_s += estimate
        if self.timeline is not None:
            self.timeline.compute(seconds)
        if self.estimate is not None:
            self.estimate.compute(estimate)
        if self.sites is not None:
            self.sites.launched(moved, seconds, estimate)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if inside_backend():
            return out
        packet = func._overloadpacket
        if packet in PROFILES:
            for launch in PROFILES[packet](*args, **kwargs, out=out):
                self._launched(launch.kernel, launch.flops, launch.bytes, 0, kernel=True)
            return out
        name = packet.__name__
        flops = self._flops(func, args, kwargs, out)
        if func.namespace in LAUNCHING_NAMESPACES and not func.is_view and name not in _NOT_LAUNCHES \
                and any(isinstance(r.type, torch.TensorType) for r in func._schema.returns):
            self._launched(name, flops, tensor_bytes((args, kwargs)), tensor_bytes(out), args, kwargs,
                           kernel=func.namespace != "aten")
        elif flops:
            self.flops += flops
            self.flops_by_op[name] += flops
        return out
