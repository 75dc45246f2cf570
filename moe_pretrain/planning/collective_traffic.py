"""Calls and bytes of every collective a piece of code issues, per process group (the dry run's meter, and a
real run's, to compare them).

Every collective, ours (parallel/collectives.py), megatron-core's and torch's (the pipeline stages' sends
and receives), reaches the dispatcher as a c10d op carrying its process group, so one dispatch mode sees
them all, on any backend: gloo, NCCL, or the dry run's fake one. Bytes are the payload each call hands
over: the all-reduced tensor, an all-gather's gathered output, a reduce-scatter's input, the rows an
all-to-all sends, the tensor a send or receive carries. Counts are of calls and tensor sizes: exact and
the same on every machine.
"""

import collections
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moe_pretrain.config import ClusterConfig
from moe_pretrain.planning.calibration import Calibration
from moe_pretrain.planning.collective_estimate import collective_estimate
from moe_pretrain.planning.host_reads import project_site
from moe_pretrain.planning.op_census import tensor_bytes as _bytes
from moe_pretrain.planning.step_time import collective_seconds, sent_share
from moe_pretrain.planning.timeline import Timeline

_PLANNING = str(Path(__file__).resolve().parent) + "/"
_COLLECTIVES = str(Path(__file__).resolve().parents[2] / "parallel" / "collectives.py")
"""Frames never named as a collective's site: the meters', and the module every collective passes through."""
_INPUT_IS_PAYLOAD = ("alltoall", "_reduce_scatter_base_", "reduce_scatter_")
"""Ops whose input (their second argument) is what they move; the others move their largest tensor."""




def _payload(name: str, args: tuple) -> int:
    if name.startswith(_INPUT_IS_PAYLOAD):
        return _bytes(args[1])
    tensors = [a for a in args if isinstance(a, torch.Tensor | list | tuple)]
    return max((_bytes(t) for t in tensors), default=0)


class CollectiveTraffic(TorchDispatchMode):
    """with CollectiveTraffic({"tp": tp_group, ...}) as traffic: ... ; traffic.calls / traffic.bytes, Counters
    keyed by (group name, op). A group not named is listed by its size ('world of 8', 'group of 2')."""

    def __init__(self, groups: dict[str, dist.ProcessGroup | None], cluster: ClusterConfig | None = None,
                 timeline: Timeline | None = None, calibration: Calibration | None = None,
                 estimate: Timeline | None = None):
        """cluster, timeline: each collective's time on the cluster's links told to the timeline as issued;
        calibration, estimate: its estimate (planning/collective_estimate.py) told to the estimate's timeline."""
        super().__init__()
        self.cluster, self.timeline = cluster, timeline
        self.calibration, self.estimate = calibration, estimate
        self._names: dict[str, str] = {}
        self.ranks: dict[str, list[int]] = {}
        """Each group's global ranks, by name."""
        for name, group in groups.items():
            if group is not None and group.group_name not in self._names:
                self._names[group.group_name] = name
                self.ranks[name] = dist.get_process_group_ranks(group)
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.bytes_by_site: collections.Counter = collections.Counter()
        """Payload bytes by (group, op, the innermost line of the project's code that issued it)."""

    def by_group(self) -> dict[str, tuple[int, int]]:
        """group name -> (calls, bytes) over every op."""
        table: dict[str, list[int]] = {}
        for (group, _), calls in self.calls.items():
            row = table.setdefault(group, [0, 0])
            row[0] += calls
        for (group, _), size in self.bytes.items():
            table[group][1] += size
        return {group: (calls, size) for group, (calls, size) in sorted(table.items())}

    def sent_bytes(self) -> dict[str, float]:
        """Per group, the bytes one GPU sends (a ring's (n - 1) / n of a gathered or scattered payload, twice
        that for an all-reduce: launch.plan's communication columns count so)."""
        sent: dict[str, float] = {}
        for (group, op), size in self.bytes.items():
            sent[group] = sent.get(group, 0.0) + size * sent_share(op, len(self.ranks.get(group, [])))
        return dict(sorted(sent.items()))

    def _group_name(self, args: tuple) -> str:
        for arg in args:
            if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith(".ProcessGroup"):
                group = dist.ProcessGroup.unbox(arg)
                if group.group_name not in self._names:
                    name = self._names[group.group_name] = f"group of {group.size()}"
                    self.ranks[name] = dist.get_process_group_ranks(group)
                return self._names[group.group_name]
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            key = (self._group_name(args), name)
            payload = _payload(name, args)
            self.calls[key] += 1
            self.bytes[key] += payload
            self.bytes_by_site[(*key, project_site((_PLANNING, _COLLECTIVES)))] += payload
            ranks = self.ranks.get(key[0], [])
            if self.timeline is not None:
                self.timeline.issue(key[0], collective_seconds(name, payload, ranks, self.cluster))
            if self.estimate is not None:
                self.estimate.issue(key[0], *collective_estimate(self.calibration, name, payload, ranks,
                                                                 self.cluster))
        return func(*args, **(kwargs or {}))


PLAN_COLUMNS = ("tp", "ep", "pp", "cp", "dp")
"""launch.plan's communication columns."""


def plan_columns(sent: dict[str, float]) -> dict[str, float]:
    """Sent bytes by group (CollectiveTraffic.sent_bytes) in launch.plan's columns: cp takes every context-
    parallel group, ep the node dispatch's rail and node groups too, dp every group that reduces gradients or
    the balancers' statistics."""
    columns = dict.fromkeys(PLAN_COLUMNS, 0.0)
    for group, size in sent.items():
        if group.startswith(("cp", "ep")):
            columns[group[:2]] += size
        elif group in ("dp", "edp", "tp x dp"):
            columns["dp"] += size
        elif group in columns:
            columns[group] += size
    return columns
