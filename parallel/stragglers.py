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

Every rank sends one vector of a few floats per window (WindowFigures.vector) in one all-gather; every rank
judges the same figures, and rank 0 logs and records them (<run_dir>/stragglers.jsonl, one line per window
with every rank's figures and what was found).
"""

import collections
import dataclasses
import json
import logging
import os
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.collectives import all_gather_stacked, gather_objects
from parallel.state import ParallelContext

log = logging.getLogger(__name__)

SLOW_HOSTS_FILE = "slow_hosts"
"""<run_dir>/slow_hosts: hosts the check marked for exclusion (logging.straggler.action=exclude), one a line; the
SLURM job excludes those it holds as it next requeues (launch/slurm_outcome.py). Delete a line to let a repaired
host back."""

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


class StragglerCheck:
    """Run at the end of every window by the trainer's step hook (training/step_hooks.StragglerWindows;
    collective: every rank calls check)."""

    def __init__(self, ctx: ParallelContext, ranks_per_node: int, threshold: float, windows: int,
                 run_dir: str | Path, mark: bool = False):
        """mark: write the named ranks' and nodes' hosts to <run_dir>/slow_hosts (logging.straggler.action=
        exclude); the run itself goes on."""
        self.ctx, self.threshold, self.windows, self.mark = ctx, threshold, windows, mark
        self.slow_hosts = Path(run_dir) / SLOW_HOSTS_FILE
        self.identities: list[RankIdentity] = gather_objects(identity_of(ctx, ranks_per_node), dist.group.WORLD
                                                             if ctx.distributed else None)
        self.streaks = Streaks.of(len(self.identities))
        self.stage_sizes = collections.Counter(i.pp for i in self.identities)
        """Ranks per pipeline stage (a straggler line says how many peers it was compared with)."""
        self.record = Path(run_dir) / "stragglers.jsonl"

    def check(self, step: int, window: WindowFigures) -> dict[str, float]:
        """Judge the window ending at `step`: log what it found (rank 0), append its record, and return the
        metrics it adds to the step's record."""
        vector = torch.tensor(window.vector(), dtype=torch.float64, device=self.ctx.device)
        group = dist.group.WORLD if self.ctx.distributed else None
        gathered = all_gather_stacked(vector, group).tolist()  # the window's one collective and host read
        figures = [WindowFigures.from_vector(values) for values in gathered]
        findings = judge(figures, self.identities, self.streaks, self.threshold, self.windows)
        if self.ctx.is_logging_rank:
            self._report(step, figures, findings)
        return {"straggler_ratio_max": max(findings.ratio), "expert_load_max": max(findings.load),
                "stragglers": float(len(findings.stragglers) + len(findings.slow_nodes))}

    def _report(self, step: int, figures: list[WindowFigures], findings: Findings) -> None:
        for rank in findings.stragglers:
            identity = self.identities[rank]
            log.warning(f"straggler: {identity.describe()} computes {findings.ratio[rank]:.2f}x the median of the "
                        f"{self.stage_sizes[identity.pp]} ranks of its pipeline stage, {self.streaks.ranks[rank]} "
                        f"windows in a row (step {step})")
        for node in findings.slow_nodes:
            ranks = [i.rank for i in self.identities if i.node == node]
            log.warning(f"straggler node {node} (host {self.identities[ranks[0]].host}): all its {len(ranks)} ranks "
                        f"({', '.join(map(str, ranks))}) compute at least {findings.node_ratio[node]:.2f}x the "
                        f"median of their stages' ranks on other nodes, {self.streaks.nodes[node]} windows in a row "
                        f"(step {step})")
        for rank in findings.expert_load:
            log.warning(f"expert load: {self.identities[rank].describe()} received {findings.load[rank]:.2f}x the "
                        f"mean rows of its expert-parallel group (step {step}): routing, not the hardware")
        if self.mark:
            self._mark_hosts([self.identities[r].host for r in findings.stragglers]
                             + [i.host for i in self.identities if i.node in findings.slow_nodes])
        with self.record.open("a") as out:
            out.write(json.dumps({
                "step": step,
                "ranks": [{"rank": i.rank, "host": i.host, "node": i.node, "pp": i.pp, "compute_s": f.compute_s,
                           "step_s": f.step_s,
                           "blocked_s": f.blocked_s, "parts_s": f.parts_s, "data_s": f.data_s,
                           "checkpoint_s": f.checkpoint_s,
                           "steps": f.steps, "expert_rows": f.expert_rows, "ratio": findings.ratio[i.rank],
                           "load": findings.load[i.rank]} for i, f in zip(self.identities, figures, strict=True)],
                "stragglers": findings.stragglers, "slow_nodes": findings.slow_nodes,
                "node_ratio": {str(node): r for node, r in findings.node_ratio.items()},
                "expert_load": findings.expert_load}) + "\n")

    def _mark_hosts(self, hosts: list[str]) -> None:
        """Add these hosts to <run_dir>/slow_hosts (those not there yet), for the next requeue to exclude."""
        marked = set(self.slow_hosts.read_text().split()) if self.slow_hosts.is_file() else set()
        new = [host for host in dict.fromkeys(hosts) if host not in marked]
        if new:
            with self.slow_hosts.open("a") as out:
                out.writelines(f"{host}\n" for host in new)
            log.warning(f"straggler: marked {', '.join(new)} in {self.slow_hosts}: the next requeue excludes "
                        "it (logging.straggler.action=exclude); this run goes on")
