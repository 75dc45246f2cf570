"""Slow ranks named, not guessed: every logging.straggler.every steps the ranks' window figures are brought
together in one collective and judged.

At 2048 GPUs a rank that computes 30% slower never hangs: every collective waits for it, so every rank's step
time is the same and says nothing. A window's figures (training/step_telemetry.py) split each rank's step into
its own compute and its time blocked in collectives. A rank is a straggler when its compute exceeds the median
of its peers doing the same work (its pipeline stage's ranks) by more than logging.straggler.threshold for
logging.straggler.windows windows in a row; the ranks that wait for it have long blocked times and ordinary
compute, and are not flagged (the cause, not its victims). When every rank of a node computes more than the
threshold over its stage's ranks on other nodes, for as many windows, the node is named instead of its ranks
(thermal, PCIe, a NIC). A rank whose experts received more than the threshold over its
expert-parallel group's mean rows is reported as expert load, not as slow hardware, even when it is also slow:
routing, not the machine, is the cause.

Every rank sends one vector of a few floats per window (WindowFigures.vector) in one all-gather and every rank
judges the same figures (operations/stragglers.py gathers them, logs what was found and keeps the records);
this module is the judgement alone.
"""

import dataclasses
import os
import socket
import statistics
from dataclasses import dataclass

import torch.distributed as dist

from parallel.state import ParallelContext

GROUPS = ("tp", "cp", "dp", "ep", "edp", "pp", "world", "other")
"""The groups whose blocked time is reported, in the order the window's figures carry them."""
PARTS = ("forward_backward", "optimizer")
"""The step's parts timed on the device (training/step_telemetry.py), blocked time included."""


@dataclass
class WindowFigures:
    """One rank's sums over a window of steps, in seconds (expert rows: a count)."""

    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    checkpoint_s: float = 0.0
    blocked_s: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    expert_rows: int = 0
    parts_s: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    @property
    def compute_s(self) -> float:
        """The step time this rank spent neither blocked in collectives nor waiting for data or a checkpoint."""
        return max(self.step_s - sum(self.blocked_s.values()) - self.data_s - self.checkpoint_s, 0.0)

    def vector(self) -> list[float]:
        """The figures the window's one collective carries, in a fixed order (from_vector reads them back)."""
        return [self.steps, self.step_s, self.data_s, self.checkpoint_s, float(self.expert_rows),
                *(self.blocked_s[g] for g in GROUPS), *(self.parts_s[p] for p in PARTS)]

    @classmethod
    def from_vector(cls, values: list[float]) -> "WindowFigures":
        steps, step_s, data_s, checkpoint_s, rows, *rest = values
        blocked, parts = rest[:len(GROUPS)], rest[len(GROUPS):]
        return cls(int(steps), step_s, data_s, checkpoint_s, dict(zip(GROUPS, blocked, strict=True)), int(rows),
                   dict(zip(PARTS, parts, strict=True)))


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank runs and what it does: what a straggler line names."""

    rank: int
    host: str
    node: int
    """Which node: consecutive blocks of the launcher's ranks per node (parallel/state.ranks_per_node)."""
    local_gpu: int
    """LOCAL_RANK: on a GPU node the index of its GPU, on a CPU run its place among the node's processes."""
    tp: int
    pp: int
    ep: int
    dp: int
    cp: int
    """Its context-parallel rank at parallel.cp (a stage may run another cp)."""
    ep_group: tuple[int, ...]
    """The global ranks of its expert-parallel group (expert load is compared within it)."""

    def describe(self) -> str:
        return (f"rank {self.rank} (host {self.host}, local rank {self.local_gpu}; tp {self.tp} pp {self.pp} "
                f"ep {self.ep} dp {self.dp} cp {self.cp})")


def identity_of(ctx: ParallelContext, ranks_per_node: int) -> RankIdentity:
    ep_group = tuple(dist.get_process_group_ranks(ctx.ep_group)) if ctx.ep_group is not None else (ctx.rank,)
    return RankIdentity(ctx.rank, socket.gethostname(), ctx.rank // ranks_per_node,
                        int(os.environ.get("LOCAL_RANK", "0")), ctx.tp_rank, ctx.pp_rank, ctx.ep_rank, ctx.dp_rank,
                        ctx.context(ctx.layout.cp).rank, ep_group)


@dataclass
class Findings:
    """What one window showed. ratio: each rank's compute over its stage's median; load: its experts' rows
    over its expert-parallel group's mean."""

    ratio: list[float]
    load: list[float]
    stragglers: list[int] = dataclasses.field(default_factory=list)
    """Ranks slow for windows in a row (not explained by expert load; not on a slow node)."""
    node_ratio: dict[int, float] = dataclasses.field(default_factory=dict)
    """Each node's least rank compute over the median of its stage's ranks on other nodes (_node_ratios)."""
    slow_nodes: list[int] = dataclasses.field(default_factory=list)
    """Nodes all of whose ranks are slow beside their peers on other nodes for windows in a row (their ranks
    are not listed one by one)."""
    expert_load: list[int] = dataclasses.field(default_factory=list)
    """Ranks whose experts received more than the threshold over their group's mean."""


@dataclass
class Streaks:
    """Windows in a row each rank (and each node) was found slow; judge updates them window by window."""

    ranks: list[int]
    nodes: dict[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, world_size: int) -> "Streaks":
        return cls([0] * world_size)

    def state_dict(self) -> dict:
        return {"ranks": list(self.ranks), "nodes": {str(node): count for node, count in self.nodes.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Go on counting where a checkpoint of the same world size stopped; on another, start over (its ranks
        and nodes are other machines)."""
        if len(state.get("ranks", ())) != len(self.ranks):
            return
        self.ranks[:] = state["ranks"]
        self.nodes.clear()
        self.nodes.update({int(node): count for node, count in state["nodes"].items()})


def _node_ratios(compute: list[float], identities: list[RankIdentity],
                 nodes: dict[int, list[int]]) -> dict[int, float]:
    """How much slower each node's ranks are than their peers elsewhere: the least, over its ranks, of a rank's
    compute over the median of its stage's ranks on other nodes. Peers on other nodes, not the whole stage: a
    node can be a large part of its stage (half of it, on two nodes), and then the stage's median lies among the
    node's own ranks. A single node, or a node of one rank (a straggler then), has no ratio."""
    by_stage: dict[int, list[int]] = {}
    for i in identities:
        by_stage.setdefault(i.pp, []).append(i.rank)
    ratios = {}
    for node, ranks in nodes.items():
        if not 1 < len(ranks) < len(identities):
            continue
        own, medians = set(ranks), {}
        for pp in {identities[r].pp for r in ranks}:
            others = [compute[r] for r in by_stage[pp] if r not in own]
            medians[pp] = statistics.median(others) if others else 0.0
        ratios[node] = min(compute[r] / medians[identities[r].pp] if medians[identities[r].pp] > 0 else 1.0
                           for r in ranks)
    return ratios


def judge(figures: list[WindowFigures], identities: list[RankIdentity], streaks: Streaks, threshold: float,
          windows: int) -> Findings:
    """This window's findings; streaks is updated in place."""
    compute = [f.compute_s / max(f.steps, 1) for f in figures]
    stages: dict[int, list[float]] = {}
    for i in identities:
        stages.setdefault(i.pp, []).append(compute[i.rank])
    medians = {pp: statistics.median(values) for pp, values in stages.items()}
    ratio = [compute[i.rank] / medians[i.pp] if medians[i.pp] > 0 else 1.0 for i in identities]
    groups = {i.ep_group for i in identities}
    means = {group: statistics.fmean(figures[r].expert_rows for r in group) for group in groups}
    load = [figures[i.rank].expert_rows / means[i.ep_group] if means[i.ep_group] > 0 else 1.0 for i in identities]
    findings = Findings(ratio, load)
    findings.expert_load = [i.rank for i in identities if load[i.rank] > 1 + threshold]
    loaded = set(findings.expert_load)
    for i in identities:
        slow = ratio[i.rank] > 1 + threshold and i.rank not in loaded
        streaks.ranks[i.rank] = streaks.ranks[i.rank] + 1 if slow else 0
    nodes: dict[int, list[int]] = {}
    for i in identities:
        nodes.setdefault(i.node, []).append(i.rank)
    findings.node_ratio = _node_ratios(compute, identities, nodes)
    for node, least in findings.node_ratio.items():
        slow = least > 1 + threshold and not loaded.intersection(nodes[node])
        streaks.nodes[node] = streaks.nodes.get(node, 0) + 1 if slow else 0
    findings.slow_nodes = [node for node, streak in streaks.nodes.items() if streak >= windows]
    on_slow_node = {r for node in findings.slow_nodes for r in nodes[node]}
    findings.stragglers = [i.rank for i in identities
                           if streaks.ranks[i.rank] >= windows and i.rank not in on_slow_node]
    return findings
