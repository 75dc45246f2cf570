"""The layouts that fit every stage, ranked by the plan's predicted days (`launch.plan --propose`).

MemoryPlanner.propose picks the smallest layout that fits: least tp x pp, then least cp, then the cheapest
recomputation. The smallest is not the fastest. A larger tp or pp can fit a stage without the re-forward of full
recomputation, and more context parallelism can do the same at the cost of its exchanges. Here every run layout
that propose tries is priced by the plan's own step time (plan_step_time.planned_step: the FLOPs at the peak, the
recomputation's included; each communication column on the links its group crosses; the pipeline bubble). On
each run layout every stage takes its fastest fitting layout, trying for each cp and MLA exchange the cheapest
recomputation that fits with HEADROOM. Run layouts that fit every stage are ranked by total days.

The ranking sees only what the plan's model sees. The all-to-all is counted whole (dispatch chunks and overlap
are the dry run's timeline). Compute is bounded by its FLOPs, without the memory-bound kernels the dry run's
roofline adds. So trace the winner and the runner-up with the dry run before taking either.
"""

from dataclasses import dataclass

from moe_pretrain.config.stage import Stage, resolve_stages
from moe_pretrain.gpus import GpuSpec
from moe_pretrain.planning.plan_step_time import PlannedStep, planned_step
from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout


@dataclass(frozen=True)
class RankedLayout:
    run: RunLayout
    stages: list[tuple[Stage, PlannedStep]]
    """Each stage with its fastest fitting layout on this run layout, and its planned step."""

    @property
    def days(self) -> float:
        return sum(step.days for _, step in self.stages)


def fastest_layouts(planner: MemoryPlanner, gpus: int, gpu_bytes: float, gpu: GpuSpec, count: int = 3
                    ) -> list[RankedLayout]:
    """The `count` run layouts of `gpus` GPUs on which every stage fits, fastest first (fewest planned days). The
    planner's cached states and layers are those the smallest-layout search (MemoryPlanner.propose) made."""
    cfg, ranked = planner.cfg, []
    for run in planner.run_layouts(gpus):
        stages = []
        for stage in resolve_stages(cfg):
            steps = [(fitted, planned_step(cfg, run, fitted, result["ranks"], gpu, cfg.cluster))
                     for fitted, result in planner.stage_layouts_that_fit(run, stage, gpu_bytes, per_exchange=True)]
            if not steps:
                break
            stages.append(min(steps, key=lambda pair: pair[1].step_s))
        else:
            ranked.append(RankedLayout(run, stages))
    return sorted(ranked, key=lambda r: r.days)[:count]
