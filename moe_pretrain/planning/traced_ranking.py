"""The plan's fastest layouts re-ranked by the dry run's step (`launch.plan --propose --trace N`).

fastest_layouts ranks run layouts by the plan's model: FLOPs at the peak, the all-to-all counted whole. A GPU's
step also pays the memory-bound kernels and the launches, and waits only for the exchanges the code leaves
exposed: dispatch chunks (parallel.dispatch_chunks) and paired micro-batches (parallel.overlap_micro_batches) hide
some, context parallelism's chunk forms add launches. Only the dry run sees those; traced, the plan's winner has
lost to the configured layout before (docs/planning.md). So the plan's first N for one stage, and the config's own
layout beside them, each at every dispatch chunk count asked, are played by the dry run on the stage's first
micro-batches and scaled to its whole step as `launch.plan --traces` does (plan_step_time.traced_stage_step).
They are ranked by that step on the calibrated estimate (planning/calibration.py; the roofline bound where the
traces carry none), those whose traced peak leaves TRACED_HEADROOM of the GPU first.

What it cannot tell is what the dry run cannot: kernels' real speed, numerics. One rank per candidate by default
(the middle pipeline rank, a step's usual slowest); the first and last ranks hold more or less state and may
not fit where the middle one does (roles=True plays all three, at three times the cost).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from moe_pretrain.config import Config, ConfigError
from moe_pretrain.config.stage import Stage, resolve_stages
from moe_pretrain.gpus import GpuSpec
from moe_pretrain.planning.dry_run import first_micro_batches, role_ranks
from moe_pretrain.planning.fastest_layouts import RankedLayout
from moe_pretrain.planning.plan_step_time import PlannedStep, planned_step, traced_stage_step
from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout, pipeline_layers_of
from parallel.state import resolve_layout

TRACED_HEADROOM = 0.08
"""The share of the GPU a traced peak leaves free to count as fitting: the plan asks 10% (HEADROOM) of a count
that runs 8-17% above the trace; the allocator's fragmentation and the NCCL buffers live in the rest."""

Play = Callable[[Config, int, list[int], int], list[dict]]
"""Plays ranks of a job: (config, GPUs, ranks, stage index) -> their traces (launch.dryrun.play)."""


@dataclass(frozen=True)
class Candidate:
    run: RunLayout
    stages: list[Stage]
    """Every stage with its layout (the run's other stages must be valid too: start-up checks them all)."""
    dispatch_chunks: int
    planned: PlannedStep
    """The plan's step of the traced stage."""
    source: str
    """Where it comes from: its place in the plan's ranking, or "configured"."""

    def describe(self, stage: int) -> str:
        return f"{self.run.describe()} {self.stages[stage].describe()} chunks={self.dispatch_chunks}"


@dataclass(frozen=True)
class TracedCandidate:
    candidate: Candidate
    traces: list[dict]
    step: PlannedStep
    """The stage's step from the traces (traced_stage_step) on the estimate, where they carry one."""
    bound: PlannedStep
    """The same on the roofline bound."""
    cut_micro_batches: int

    @property
    def peak_bytes(self) -> int:
        return max(trace["peak_bytes"] for trace in self.traces)

    def fits(self, gpu_bytes: float) -> bool:
        return self.peak_bytes <= (1 - TRACED_HEADROOM) * gpu_bytes


def candidates(planner: MemoryPlanner, gpus: int, stage: int, ranked: list[RankedLayout], chunks: list[int],
               gpu: GpuSpec) -> tuple[list[Candidate], list[str]]:
    """The ranked run layouts, then the config's own where it is not among them, each at every chunk count; and
    why the config's own is left out, when its layout cannot run the stage at all."""
    layouts = [(r.run, [fitted for fitted, _ in r.stages], r.stages[stage][1], f"plan #{place}")
               for place, r in enumerate(ranked, start=1)]
    cfg = planner.cfg
    p = cfg.parallel
    run = RunLayout(gpus, p.tp, p.pp, p.ep, p.vpp)
    own = list(resolve_stages(cfg))
    left_out = []
    if all((r, s) != (run, own) for r, s, _, _ in layouts):
        if problems := planner.problems(run, own[stage]):
            left_out.append(f"{run.describe()} {own[stage].describe()} (configured): {'; '.join(problems)}")
        else:
            result = planner.stage(run, own[stage])
            layouts.append((run, own, planned_step(cfg, run, own[stage], result["ranks"], gpu, cfg.cluster),
                            "configured"))
    return [Candidate(run, stages, c, planned, source) for run, stages, planned, source in layouts
            for c in chunks], left_out


def candidate_config(cfg: Config, candidate: Candidate) -> Config:
    """cfg with the candidate's run layout, dispatch chunks and every stage's layout."""
    run = candidate.run
    parallel = dataclasses.replace(cfg.parallel, tp=run.tp, pp=run.pp, ep=run.ep, vpp=run.vpp,
                                   dispatch_chunks=candidate.dispatch_chunks,
                                   pipeline_layers=pipeline_layers_of(cfg.parallel.pipeline_layers, run))
    stages = [dataclasses.replace(entry, cp=chosen.cp, recompute=chosen.recompute, micro_batches=chosen.micro_batches,
                                  cp_mla=chosen.cp_mla if chosen.cp > 1 else "",  # (what has no effect is refused)
                                  saved_inputs=chosen.saved_inputs if chosen.recompute == "full" else "")
              for entry, chosen in zip(cfg.stages, candidate.stages, strict=True)]
    return dataclasses.replace(cfg, parallel=parallel, stages=stages)


def layout_overlay(cfg: Config, candidate: Candidate) -> dict:
    """The config layer that gives cfg the candidate's layout (YAML-ready: layer it over cfg's files last)."""
    chosen = candidate_config(cfg, candidate)
    return {"parallel": {key: getattr(chosen.parallel, key)
                         for key in ("tp", "pp", "ep", "vpp", "dispatch_chunks", "pipeline_layers")},
            "stages": [dataclasses.asdict(stage) for stage in chosen.stages]}


def cut_micro_batches(micro_batches: int, pp: int) -> int:
    """The micro-batches a candidate's trace runs: the fewest that fill its pipeline (a multiple of pp) and, at
    two or more, pair a forward with a backward (parallel.overlap_micro_batches), dividing the stage's."""
    for count in range(pp, micro_batches + 1, pp):
        if count >= 2 and micro_batches % count == 0:
            return count
    return micro_batches


def traced_ranking(cfg: Config, gpus: int, stage: int, found: list[Candidate], play: Play, gpu: GpuSpec,
                   gpu_bytes: float, roles: bool = False) -> tuple[list[TracedCandidate], list[str]]:
    """Each candidate played (its middle pipeline rank, or one of each role), fastest fitting first, then
    those that do not fit; and a line for each candidate the run's start-up checks refuse."""
    traced, refused = [], []
    for candidate in found:
        chosen = candidate.stages[stage]
        cut = cut_micro_batches(chosen.micro_batches, candidate.run.pp)
        try:
            played = first_micro_batches(candidate_config(cfg, candidate), stage, cut)
            resolve_layout(played, gpus)
        except (ConfigError, ValueError) as err:
            refused.append(f"{candidate.describe(stage)}: {err}")
            continue
        ranks = role_ranks(gpus, candidate.run.pp)
        if not roles:
            ranks = [gpus // candidate.run.pp * (candidate.run.pp // 2)]
        traces = play(played, gpus, ranks, stage)
        bound = traced_stage_step(cfg, candidate.run, chosen, traces, gpu)
        estimated = all(trace["estimate"] for trace in traces)
        step = traced_stage_step(cfg, candidate.run, chosen, traces, gpu, "estimate") if estimated else bound
        traced.append(TracedCandidate(candidate, traces, step, bound, cut))
    traced.sort(key=lambda t: (not t.fits(gpu_bytes), t.step.step_s))
    return traced, refused
