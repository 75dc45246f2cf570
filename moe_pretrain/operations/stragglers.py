"""The straggler check's side of the job: every window, the ranks' figures gathered in one collective, judged
(parallel/stragglers.py, the judgement), and what was found logged by rank 0 and kept in the run directory:
<run_dir>/stragglers.jsonl (one line per window with every rank's figures and the findings) and, with
logging.straggler.action=exclude, <run_dir>/slow_hosts for the next requeue to leave out. The check runs as a
step hook the run loop adds (operations/run_loop.py).
"""

import collections
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_pretrain.config import Config
from moe_pretrain.training.step_hooks import StepHook
from moe_pretrain.training.step_telemetry import StepTelemetry
from parallel.collectives import all_gather_stacked, gather_objects
from parallel.state import ParallelContext, ranks_per_node
from parallel.stragglers import Findings, RankIdentity, Streaks, WindowFigures, identity_of, judge

log = logging.getLogger(__name__)

SLOW_HOSTS_FILE = "slow_hosts"
"""<run_dir>/slow_hosts: hosts the check marked for exclusion (logging.straggler.action=exclude), one a line; the
SLURM job excludes those it holds as it next requeues (launch/slurm_outcome.py). Delete a line to let a repaired
host back."""



class StragglerCheck:
    """Run at the end of every window by the StragglerWindows step hook (collective: every rank calls check)."""

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


class StragglerWindows(StepHook):
    """logging.straggler: at the end of every window of logging.straggler.every steps, the ranks' figures (the
    step telemetry's window: training/step_telemetry.py) judged together (its one all-gather: every rank calls
    metrics every step); the step's record gets what it found. Its state: how many windows in a row each rank
    and node was found slow, so a resumed run goes on counting."""

    name = "straggler_windows"

    def __init__(self, check: StragglerCheck, telemetry: StepTelemetry, every: int):
        self.check, self.telemetry, self.every = check, telemetry, every

    def metrics(self, step: int) -> dict[str, float]:
        return self.check.check(step, self.telemetry.take()) if step % self.every == 0 else {}

    def state_dict(self) -> dict[str, Any]:
        return self.check.streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check.streaks.load_state_dict(state)


def straggler_windows(cfg: Config, parallel: ParallelContext, telemetry: StepTelemetry) -> StragglerWindows | None:
    """The straggler check's step hook when logging.straggler turns it on for this run (None otherwise)."""
    if not telemetry.on:
        return None
    straggler = cfg.logging.straggler
    check = StragglerCheck(parallel, ranks_per_node(cfg), straggler.threshold, straggler.windows,
                           cfg.train.run_dir, mark=straggler.action == "exclude")
    return StragglerWindows(check, telemetry, straggler.every)
