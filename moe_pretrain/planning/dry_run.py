"""One rank of an N-GPU job played in this process: its real training step, with fake tensors over the fake
process-group backend, and what the step allocates, computes, sends and reads on the host.

The rank is built as the job builds it: the config's layout over a world of N (megatron-core's groups,
created through parallel/state.init_parallel over torch's "fake" backend, which sends nothing and answers
every collective at once), its own shards materialised as fake tensors (shapes, dtypes, no storage, no
arithmetic; initial values are not drawn), the real data loader's batches for its slice of the global
batch, the real step (Trainer.train_step: micro-batches or the pipeline schedule, forward, backward,
gradient reduction, the sharded optimizer's update, the balancing update). What the model's arithmetic
would decide and the host reads comes from stated assumptions (ops/host_values.py,
planning/assumed_values.py); what the data decides is computed for real.

The same meters run on a real multi-process run (traced_step with no fake mode): the tests compare a dry
run with a gloo run of the same layout, rank by rank.
"""

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpu_kernels.choice import Kernels
from gpu_kernels.fast_paths import fast_paths, resolve_for_gpu
from gpu_kernels.fast_paths import resolve as resolve_kernels
from moe_pretrain.config import Config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.dtypes import DTYPES
from moe_pretrain.gpus import GPUS, GpuSpec
from moe_pretrain.model.counts import count
from moe_pretrain.ops.host_values import AssumedHostValues
from moe_pretrain.planning.assumed_values import AssumedValues
from moe_pretrain.planning.calibration import Calibration
from moe_pretrain.planning.collective_traffic import CollectiveTraffic
from moe_pretrain.planning.compute_sites import ComputeSites
from moe_pretrain.planning.expert_traffic import plan_ranks_per_node
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.planning.op_census import OpCensus
from moe_pretrain.planning.peak_sites import PeakSites
from moe_pretrain.planning.timeline import Timeline
from moe_pretrain.training import Trainer
from parallel.collectives import observing
from parallel.paired_passes import pairs_run
from parallel.state import ParallelContext, destroy_parallel, init_parallel

log = logging.getLogger(__name__)
PEAK_SITES = 16
"""How many of the peak's largest holders a trace keeps."""
COMPUTE_SITES = 40
"""How many of the slowest lines of compute a trace keeps."""


@dataclass
class StepTrace:
    """What one rank's first training step did (counted, the same on every machine)."""

    rank: int
    layout: str
    role: str
    """Its place in the pipeline: first / middle / last stage, or the whole model."""
    pipeline_rank: int
    """Its pipeline stage (the plan's row: MemoryPlanner.stage(...)["ranks"][pipeline_rank])."""
    cp_rank: int
    """Its place in the step's context-parallel group: which fragments of each row it holds, and so what MLA's
    latent exchange sends it (the plan prices that rank's: StageDocuments.cp_rank)."""
    dp_rank: int
    """Which rows of the step's batches it ran (the plan beside it prices their documents)."""
    kernels: dict[str, str]
    """Each fast path's state as the model was built (gpu_kernels/fast_paths.fast_paths)."""
    micro_batches: int
    """The step's micro-batches (a cut step's: --micro-batches)."""
    build_peak_bytes: int
    """Peak live tensor bytes while the rank's trainer was built (state, data)."""
    state_bytes: int
    """Live tensor bytes when the step began (parameters, gradient and optimizer buffers, data)."""
    peak_bytes: int
    """Peak live tensor bytes from the build through the step."""
    end_bytes: int
    peak_sites: dict[str, int]
    """What holds the peak: bytes by 'op at file:line' that made them, the largest first (planning/peak_sites.py)."""
    param_bytes: int
    """Of the rank's state after the step: its parameters (the optimizer's flat buckets)..."""
    grad_bytes: int
    """...their gradient buffers..."""
    optimizer_bytes: int
    """...and the optimizer's moments (Adam's two, or Muon's one). The rest of the peak is activations,
    transients and the data."""
    flops: int
    launches: int
    """aten ops that compute (planning/op_census.py): kernel launches on a GPU."""
    launches_by_op: dict[str, int] = field(default_factory=dict)
    flops_by_op: dict[str, int] = field(default_factory=dict)
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    """The launches' bytes read and written, by aten op (the largest first)."""
    collectives: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Group -> (calls, payload bytes) in the step."""
    sent_bytes: dict[str, float] = field(default_factory=dict)
    """Group -> bytes this GPU sends in the step (launch.plan's measure)."""
    collective_sites: dict[str, int] = field(default_factory=dict)
    """'group op at file:line' -> payload bytes, the largest first."""
    host_reads: dict[str, int] = field(default_factory=dict)
    """'kind at file:line' -> reads in the step."""
    compute_by_component: dict[str, list] = field(default_factory=dict)
    """Component -> [launches, bytes read and written, roofline seconds], the slowest first
    (planning/compute_sites.py: backward launches under the forward line that made them)."""
    compute_by_site: dict[str, list] = field(default_factory=dict)
    """The same by the line of the project's code, the COMPUTE_SITES slowest."""
    bytes_moved: int = 0
    """Bytes the launches read and write."""
    compute_s: float = 0.0
    """The launches' roofline time on the target GPU (planning/step_time.py)."""
    compute_once_s: float = 0.0
    """Of compute_s, the launches done once a step whatever its micro-batches (the optimizer, the step's hooks,
    the weights' casts: step_reuse.repeats_per_micro_batch); a cut step's other compute scales with the
    stage's micro-batches (plan_step_time.traced_stage_step)."""
    attended_keys: float = 0.0
    """The keys an attention query of the step's batches saw (model/counts.attended_keys): the MFU's model
    FLOPs price MLA's attention over the documents the step ran."""
    collective_s: dict[str, float] = field(default_factory=dict)
    """Per group, its collectives' time on the target fabric."""
    exposed_s: dict[str, float] = field(default_factory=dict)
    """Per group, the time the compute waited for its collectives on the step's timeline (planning/timeline.py)."""
    exposed_paired_s: dict[str, float] = field(default_factory=dict)
    """Of exposed_s, the waits inside pairs of a forward and a backward (parallel.overlap_micro_batches) and between
    one pair and the next: the steady state's, which scale with the pairs."""
    pairs: int = 0
    """Pairs of a forward and a backward the step ran (0 without parallel.overlap_micro_batches)."""
    step_s: float = 0.0
    """The predicted step time: compute plus the collectives' time not hidden behind it (exposed_s)."""
    mfu: float = 0.0
    """Model FLOPs per GPU (model/counts.py's for the step's documents, without recomputation) over step_s x the
    GPU's peak."""
    estimate: dict = field(default_factory=dict)
    """The same step priced by the GPU's calibration table (planning/calibration.py; empty without one): its
    `calibration` (the file), `compute_s` (the kernels, and the stream's stalls for the host and beside collectives:
    `kernels_s`, `host_wait_s`, `contention_s`), `compute_once_s`, `collective_s`, `exposed_s`,
    `exposed_paired_s`, `step_s`, `mfu` (over the same model FLOPs and peak), and `compute_by_component` (seconds).
    The fields above are the roofline bound."""
    seconds: float = 0.0
    """How long the dry run took here."""


def first_micro_batches(cfg: Config, stage: int, count: int) -> Config:
    """cfg with stage `stage`'s step cut to its first `count` micro-batches (the same micro-batch, so the same
    activations; a 1F1B schedule's peak is set by its first pp): the stage's batch and tokens scale by
    count / micro-batches, its steps stay. For a dry run at full size, where a step's 64 micro-batches would
    take hours here."""
    micro = resolve_stages(cfg)[stage].micro_batches
    original = cfg.stages[stage]
    if count <= 0 or micro % count or count % cfg.parallel.pp:
        raise ValueError(f"{count} micro-batches must divide stages[{stage}]'s {micro} and be a multiple of "
                         f"parallel.pp={cfg.parallel.pp}")
    cut = dataclasses.replace(original, micro_batches=count, batch_tokens=original.batch_tokens * count // micro,
                              tokens=original.tokens * count // micro,
                              warmup_tokens=original.warmup_tokens * count // micro)
    return dataclasses.replace(cfg, stages=[cut if i == stage else s for i, s in enumerate(cfg.stages)])


def role_ranks(world_size: int, pp: int) -> list[int]:
    """One rank of each distinct role: the first pipeline stage's (the vision tower, the embeddings), a middle
    one's, the last one's (the logits, the multi-token-prediction blocks). megatron-core orders pipeline
    parallelism outermost: stage s holds ranks [s, s + 1) x world / pp."""
    per_stage = world_size // pp
    return sorted({0, per_stage * (pp // 2), per_stage * (pp - 1)})


def pipeline_role(trainer: Trainer) -> str:
    pipeline = trainer.pipeline
    if pipeline is None:
        return "whole model"
    if pipeline.holds_first:
        return "first stage" + (" (and last)" if pipeline.holds_last else "")
    return "last stage" if pipeline.holds_last else "middle stage"


def traced_step(cfg: Config, ctx: ParallelContext, fake: FakeTensorMode | None = None,
                assumptions: AssumedValues | None = None, stage: int = 0, gpu: GpuSpec = GPUS["h200"],
                kernels: Kernels | None = None, calibration: Calibration | None = None) -> StepTrace:
    """Build this rank's trainer and run the first step of stage `stage` (an index into cfg.stages) under the
    meters. fake: the dry run's mode (None: a real run); assumptions: the routing and host values assumed
    (a real run under them routes as the dry run assumes, to compare the two); kernels: the model's (None:
    this machine's); calibration: the table the estimate beside the bound prices by (None: the bound alone)."""
    start = time.perf_counter()
    if assumptions is not None:  # every host read of the trainer and its model answered by them
        kernels = dataclasses.replace(kernels or resolve_kernels(cfg, ctx.device, DTYPES[cfg.train.dtype]),
                                      host=AssumedHostValues(assumptions))
    with PeakSites() as live:
        trainer = Trainer(cfg, ctx, fake=fake, kernels=kernels)
        trainer.tokens_seen = sum(s.tokens for s in cfg.stages[:stage])
        build_peak, state = live.peak, live.live
        played = trainer.step_plan().stage
        log.info(f"rank {ctx.rank}: built in {time.perf_counter() - start:.1f} s; stage {played.name}'s first step "
                 f"({played.micro_batches} micro-batches of {played.rows // played.micro_batches} x {played.seq_len} "
                 "tokens)")
        timeline = Timeline()
        estimate = Timeline(calibration.launch_host_s, calibration.collective_sm_share) if calibration else None
        with fake or contextlib.nullcontext(), ComputeSites() as sites, \
                OpCensus(gpu, timeline, sites, calibration, estimate) as ops, \
                CollectiveTraffic(ctx.named_groups(), cfg.cluster, timeline, calibration, estimate) as traffic, \
                HostReads(estimate.host_read if estimate else None) as reads, observing(timeline), \
                observing(estimate) if estimate else contextlib.nullcontext():
            pairs_before = pairs_run()
            result = trainer.train_step()
        trainer.close()
    optimizer = trainer.optimizer
    model_flops = (count(cfg.model, played.seq_len, result.attended_keys)["flops_per_token"] * played.batch_tokens
                   / ctx.layout.world_size)
    step_s = timeline.finish(played.micro_batches)
    by_component = sites.by_component()
    priced = {}
    if estimate is not None:
        estimated_s = estimate.finish(played.micro_batches)
        priced = {"calibration": calibration.path, "compute_s": estimate.busy_s + estimate.host_wait_s
                  + estimate.contention_s, "kernels_s": ops.estimate_s, "host_wait_s": estimate.host_wait_s,
                  "contention_s": estimate.contention_s, "compute_once_s": ops.estimate_once_s,
                  "collective_s": dict(sorted(estimate.link_s.items())),
                  "exposed_s": dict(sorted(estimate.exposed_s.items())),
                  "exposed_paired_s": dict(sorted(estimate.exposed_paired_s.items())), "step_s": estimated_s,
                  "mfu": model_flops / (estimated_s * gpu.peak_flops),
                  "compute_by_component": {name: row[3] for name, row in
                                           sorted(by_component.items(), key=lambda item: -item[1][3])}}
    context = ctx.context(played.cp)
    return StepTrace(ctx.rank, ctx.layout.describe(), pipeline_role(trainer), ctx.pp_rank,
                     context.rank, context.dp_rank, fast_paths(trainer.model),
                     played.micro_batches, build_peak, state, live.peak,
                     live.live, dict(live.at_peak.most_common(PEAK_SITES)), optimizer.param_bytes(),
                     optimizer.grad_bytes(),
                     optimizer.state_bytes(), ops.flops, ops.launches,
                     dict(sorted(ops.launches_by_op.items())), dict(ops.flops_by_op.most_common()),
                     dict(ops.bytes_by_op.most_common()),
                     traffic.by_group(), traffic.sent_bytes(),
                     {f"{group} {op} at {site}": size
                      for (group, op, site), size in traffic.bytes_by_site.most_common(PEAK_SITES)},
                     {f"{kind} at {site}": n for (kind, site), n in sorted(reads.by_site.items())},
                     by_component,
                     dict(sorted(sites.by_site.items(), key=lambda item: -item[1][2])[:COMPUTE_SITES]),
                     ops.bytes_moved, ops.roofline_s, ops.once_s, result.attended_keys,
                     dict(sorted(timeline.link_s.items())),
                     dict(sorted(timeline.exposed_s.items())),
                     dict(sorted(timeline.exposed_paired_s.items())), pairs_run() - pairs_before,
                     step_s, model_flops / (step_s * gpu.peak_flops), priced, time.perf_counter() - start)


def dry_run(cfg: Config, world_size: int, rank: int, stage: int = 0, gpu: GpuSpec = GPUS["h200"],
            gpu_kernels: bool = True, calibration: Calibration | None = None) -> StepTrace:
    """Play `rank` of a `world_size`-GPU job of cfg, the first step of stage `stage`, in this process (the
    fake world is the process's default group while it runs), routing by dry_run.expert_load. gpu_kernels:
    the kernels a CUDA GPU resolves (gpu_kernels/fast_paths.resolve_for_gpu), else this machine's (to
    compare with a real run here); calibration: the GPU's table, for the estimate beside the bound."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it makes the fake world)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    os.environ.setdefault("LOCAL_RANK", "0")
    if cfg.parallel.expert_dispatch == "node":  # the launcher's ranks per node, on the cluster
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    ranks_per_node=plan_ranks_per_node(cfg)))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        ctx = init_parallel(cfg)
        kernels = resolve_for_gpu(cfg, DTYPES[cfg.train.dtype]) if gpu_kernels else None
        assumed = AssumedValues(cfg.dry_run.expert_load or None)
        return traced_step(cfg, ctx, FakeTensorMode(allow_non_fake_inputs=True), assumed, stage, gpu, kernels,
                           calibration)
    finally:
        destroy_parallel()
