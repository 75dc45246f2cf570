"""The plan's own step time and days (launch.plan): no assumed MFU.

Per pipeline rank of a stage's plan (stage_memory.MemoryPlanner.stage): its planned FLOPs at the GPU's dense
peak, its planned bytes sent per communication column over the link that column's group crosses (the groups
megatron-core makes for the layout: parallel/state.init_parallel), combined by the overlap the code issues
(step_time.predict); the stage's step is the slowest rank's with the pipeline bubble
(step_time.pipeline_step_seconds). Compute here is a bound: the plan counts FLOPs, not the bytes that
memory-bound ops move, which the dry run's roofline adds (launch.plan --traces sets its step beside this one;
docs/planning.md has both for every stage at full size).
"""

from dataclasses import dataclass

from megatron.core.parallel_state import RankGenerator

from moe_pretrain.config import ClusterConfig, Config
from moe_pretrain.config.stage import Stage
from moe_pretrain.gpus import GpuSpec
from moe_pretrain.model.counts import count
from moe_pretrain.planning.expert_traffic import plan_ranks_per_node
from moe_pretrain.planning.stage_memory import RunLayout
from moe_pretrain.planning.step_time import OVERLAPPED_GROUPS, link_bytes, link_seconds, pipeline_step_seconds, predict
from parallel.node_groups import node_blocks

ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default rank order, which parallel/state.init_parallel takes."""


def column_groups(run: RunLayout, cp: int, ranks_per_node: int = 0) -> dict[str, list[int]]:
    """The ranks of rank 0's group for each of the plan's communication columns (a layout's groups of one kind
    are translations of each other: they cross the same links). dp: the gradients' reduce group, which
    spans the context-parallel ranks too (megatron-core's data parallel with context parallel). With
    ranks_per_node, the node dispatch's rail and node groups too (parallel/node_groups.py)."""
    dp = run.gpus // (run.tp * run.pp * cp)
    dense = RankGenerator(tp=run.tp, ep=1, dp=dp, pp=run.pp, cp=cp, order=ORDER)
    experts = RankGenerator(tp=1, ep=run.ep, dp=run.gpus // (run.pp * run.ep), pp=run.pp, cp=1, order=ORDER)
    groups = {"tp": dense.get_ranks("tp")[0], "cp": dense.get_ranks("cp")[0], "dp": dense.get_ranks("dp-cp")[0],
              "pp": dense.get_ranks("pp")[0], "ep": experts.get_ranks("ep")[0]}
    if ranks_per_node:
        blocks = node_blocks(groups["ep"], ranks_per_node)
        groups.update({"ep rail": [block[0] for block in blocks], "ep node": blocks[0]})
    return groups


def plan_groups(cfg: Config, run: RunLayout, cp: int) -> dict[str, list[int]]:
    """column_groups for cfg's expert dispatch on its cluster."""
    by_node = cfg.parallel.expert_dispatch == "node"
    return column_groups(run, cp, plan_ranks_per_node(cfg) if by_node else 0)


def column_seconds(sent: dict[str, float], groups: dict[str, list[int]], cluster: ClusterConfig
                   ) -> dict[str, float]:
    """Each communication column's bytes sent per GPU (a plan row's "communication") on its group's links."""
    return {column: link_seconds(size, groups[column], cluster, all_to_all=column.startswith("ep"))
            for column, size in sent.items()}


def column_links(sent: dict[str, float], groups: dict[str, list[int]], cluster: ClusterConfig
                 ) -> tuple[float, float]:
    """(over NVLink, over the NIC) of a plan row's communication, summed over its columns."""
    split = [link_bytes(size, groups[column], cluster, all_to_all=column.startswith("ep"))
             for column, size in sent.items()]
    return sum(nvlink for nvlink, _ in split), sum(nic for _, nic in split)


@dataclass(frozen=True)
class PlannedStep:
    step_s: float
    """The stage's step: the slowest pipeline rank's, with the bubble."""
    rank_step_s: list[float]
    """Each pipeline rank's time without the bubble."""
    mfu: float
    """Model FLOPs (without recomputation) per GPU over step_s x the GPU's peak: MLA's attention priced at the
    keys a query sees (the traced documents'; the plan's own step: one document per row)."""
    days: float
    """The stage's steps at step_s."""


def _stage_step(cfg: Config, run: RunLayout, stage: Stage, times: list[float],
                gpu: GpuSpec, keys: float | None = None) -> PlannedStep:
    """The stage's step from its pipeline ranks' times; keys: the keys a query of MLA's attention sees (None: one
    document per row)."""
    model_flops = count(cfg.model, stage.seq_len, keys)["flops_per_token"] * stage.batch_tokens / run.gpus
    step = pipeline_step_seconds(max(times), run.pp, run.vpp, stage.micro_batches)
    return PlannedStep(step, times, model_flops / (step * gpu.peak_flops), stage.steps * step / 86400)


def planned_step(cfg: Config, run: RunLayout, stage: Stage, ranks: list[dict],
                 gpu: GpuSpec, cluster: ClusterConfig) -> PlannedStep:
    """ranks: MemoryPlanner.stage(...)["ranks"], one row per pipeline rank."""
    groups = plan_groups(cfg, run, stage.cp)
    times = [predict(row["flops"] / gpu.peak_flops, column_seconds(row["communication"], groups, cluster), 0.0,
                     gpu).step_s for row in ranks]
    return _stage_step(cfg, run, stage, times, gpu)


TRACE_KEYS = frozenset({"micro_batches", "compute_s", "compute_once_s", "attended_keys", "exposed_s",
                        "exposed_paired_s", "pairs", "cp_rank", "dp_rank", "estimate"})
"""What launch.plan reads of a trace (planning/dry_run.StepTrace's fields): traced_stage_step's, and the cp and dp
ranks whose rows and exchange the plan beside it prices (plan_vs_dry_run.py)."""
BASES = ("bound", "estimate")
"""How a trace's step is priced: the roofline bound, or the calibrated estimate (planning/calibration.py)."""


def traced_view(trace: dict, basis: str) -> dict:
    """A trace's figures on `basis`: its own (the bound), or its estimate's in their place; a trace played without
    a calibration table has no estimate, which is refused."""
    if basis == "bound":
        return trace
    if not trace.get("estimate"):
        raise ValueError(f"rank {trace['rank']}'s trace has no estimate (played without a calibration table for "
                         "its GPU: launch.dryrun --calibration FILE)")
    return {**trace, **trace["estimate"]}


def _scaled_waits(trace: dict, micro_batches: int) -> float:
    """A trace's waits for its collectives at the stage's micro-batches. Without pairs every micro-batch's
    passes wait alike: the waits scale with the micro-batches. With them (parallel.overlap_micro_batches) the
    unpaired passes are the warm-up forwards and cool-down backwards, as many at any micro-batch count (the
    cut step's micro-batches less its pairs), so their waits stay; the pairs' scale with the pairs. The waits
    for the optimizer's traffic (OVERLAPPED_GROUPS) come once a step."""
    cut, pairs = trace["micro_batches"], trace["pairs"]
    alone_scale = micro_batches / cut if not pairs else 1.0
    paired_scale = (micro_batches - (cut - pairs)) / pairs if pairs else 0.0
    waits = 0.0
    for group, exposed in trace["exposed_s"].items():
        paired = trace["exposed_paired_s"].get(group, 0.0)
        waits += exposed if group in OVERLAPPED_GROUPS else (exposed - paired) * alone_scale + paired * paired_scale
    return waits


def traced_stage_step(cfg: Config, run: RunLayout, stage: Stage, traces: list[dict],
                      gpu: GpuSpec, basis: str = "bound") -> PlannedStep:
    """The stage's step from dry-run traces of some of its ranks (launch.dryrun's JSON; each of the step's
    first trace["micro_batches"]), priced on `basis` (BASES): each rank's compute done per micro-batch scales to
    the stage's micro-batches, and so do its waits for per-micro-batch collectives (_scaled_waits); its compute
    done once a step (compute_once_s: the optimizer, the hooks, the weights' casts) does not; the slowest traced
    rank sets the pace. The MFU prices attention at the keys the traced documents' queries saw (their mean
    over the traces)."""
    times = []
    for trace in (traced_view(trace, basis) for trace in traces):
        scale = stage.micro_batches / trace["micro_batches"]
        once = trace["compute_once_s"]
        times.append((trace["compute_s"] - once) * scale + once + _scaled_waits(trace, stage.micro_batches))
    keys = sum(trace["attended_keys"] for trace in traces) / len(traces)
    return _stage_step(cfg, run, stage, times, gpu, keys)
