"""The dry run (launch/dryrun.py) plays a rank as the real run of the same layout does: the same live tensor
bytes, FLOPs, collectives per group and host reads, rank by rank, against a gloo run of 8 processes routing
as the dry run assumes (ops/host_values.AssumedHostValues.routed). The plan (planning/stage_memory.py) agrees
with both on each rank's bytes sent per group and its FLOPs, within PLAN_TOLERANCE."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from gpu_kernels.fast_paths import resolve_for_gpu
from launch.local import run_distributed
from moe_pretrain.config import Config, StageConfig, load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.dtypes import DTYPES
from moe_pretrain.planning.assumed_values import AssumedValues
from moe_pretrain.planning.collective_traffic import PLAN_COLUMNS, plan_columns
from moe_pretrain.planning.dry_run import role_ranks, traced_step
from moe_pretrain.planning.plan_step_time import column_seconds, plan_groups
from moe_pretrain.planning.plan_vs_dry_run import plan_of_traced_step
from moe_pretrain.planning.stage_memory import RunLayout
from parallel.collectives import gather_objects
from parallel.state import destroy_parallel, init_parallel

BASE = ["train.dtype=bfloat16", "data.prefetch=false", "eval.every=0", "logging.progress=false",
        "train.run_dir=/nonexistent", "cluster.gpus_per_node=2"]
LAYOUTS = {
    "tp2-pp2-ep2-dp2": ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "optim.name=muon",
                        "parallel.dispatch_chunks=2", "train.recompute=full", "train.recompute_exchanges=false"],
    "cp2-tp2-ep4-dp2": ["parallel.tp=2", "parallel.cp=2", "parallel.ep=4", "model.moe.qb_quantile=exact",
                        "precision.fp8=tensorwise", "parallel.expert_dispatch=node", "parallel.ranks_per_node=2",
                        "parallel.dispatch_fp8=true"],
}
WORLD = 8
PEAK_TOLERANCE = 0.02
PLAN_TOLERANCE = 0.05


def real_traces(rank: int, world_size: int, overrides: list[str], gpu_kernels: bool) -> list[dict]:
    cfg = load_config("configs/smoke.yaml", [*BASE, *overrides])
    ctx = init_parallel(cfg)
    try:
        kernels = resolve_for_gpu(cfg, DTYPES[cfg.train.dtype]) if gpu_kernels else None
        trace = traced_step(cfg, ctx, assumptions=AssumedValues(), kernels=kernels)
        return gather_objects(dataclasses.asdict(trace), dist.group.WORLD)
    finally:
        destroy_parallel()


def dry_traces(tmp_path, overrides: list[str], ranks: list[int], gpu_kernels: bool = False, world: int = WORLD
               ) -> dict[int, dict]:
    out = tmp_path / "traces.json"
    subprocess.run([sys.executable, "-m", "launch.dryrun", "configs/smoke.yaml", *BASE, *overrides,
                    "--gpus", str(world), f"--kernels={'gpu' if gpu_kernels else 'here'}",
                    *(f"--rank={r}" for r in ranks), "--json", str(out)],
                   check=True, timeout=400, capture_output=True)
    return {trace["rank"]: trace for trace in json.loads(out.read_text())}


def planned_ranks(cfg: Config, traced: list[tuple[int, int]]) -> dict[tuple[int, int], list[dict]]:
    """The plan of the unstaged run as its one stage, priced at the documents each traced rank ran: by (cp rank,
    dp rank), each pipeline rank's row (MemoryPlanner.stage)."""
    batch = cfg.data.batch_size * cfg.data.seq_len
    micro_batches = resolve_stages(cfg)[0].micro_batches
    stage = StageConfig(name="run", tokens=batch * cfg.train.steps, seq_len=cfg.data.seq_len, batch_tokens=batch,
                        micro_batches=micro_batches)
    p = cfg.parallel
    return plan_of_traced_step(dataclasses.replace(cfg, stages=[stage]), RunLayout(WORLD, p.tp, p.pp, p.ep, p.vpp),
                               0, micro_batches, traced)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_dry_run_counts_what_a_real_run_of_the_layout_does(tmp_path, layout):
    overrides = LAYOUTS[layout]
    real = run_distributed(real_traces, WORLD, overrides, False, timeout=600)
    ranks = role_ranks(WORLD, 2 if "pp2" in layout else 1)
    dry = dry_traces(tmp_path, overrides, ranks)
    for rank in ranks:
        want, got = real[rank], dry[rank]
        assert_the_same_step(got, want, rank)
        assert got["collectives"] == {group: list(v) for group, v in want["collectives"].items()}, rank
        assert got["host_reads"] == want["host_reads"], rank
        for state in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert got[state] == want[state], (rank, state)
        assert got["peak_bytes"] == pytest.approx(want["peak_bytes"], rel=PEAK_TOLERANCE), rank
        assert got["state_bytes"] == pytest.approx(want["state_bytes"], rel=PEAK_TOLERANCE), rank
    plan = planned_ranks(load_config("configs/smoke.yaml", [*BASE, *overrides]),
                         [(t["cp_rank"], t["dp_rank"]) for t in dry.values()])
    for rank in ranks:
        row = plan[dry[rank]["cp_rank"], dry[rank]["dp_rank"]][dry[rank]["pipeline_rank"]]
        sent = dry[rank]["sent_bytes"]
        planned = row["communication"]
        for column, size in plan_columns(sent).items():
            assert size == pytest.approx(plan_columns(planned)[column], rel=PLAN_TOLERANCE), (rank, column)
        for group in ("ep rail", "ep node"):  # the node dispatch's NIC and NVLink bytes, each
            assert sent.get(group, 0) == pytest.approx(planned.get(group, 0), rel=PLAN_TOLERANCE), (rank, group)
        assert dry[rank]["flops"] == pytest.approx(row["flops"], rel=PLAN_TOLERANCE), rank
    # The plan's step-time model puts each column on the links megatron-core's groups for the layout cross
    # (nodes of 2 GPUs here, so that dp, pp, cp and ep4 leave the node), as the dry run times what it sent.
    cfg = load_config("configs/smoke.yaml", [*BASE, *overrides])
    p = cfg.parallel
    groups = plan_groups(cfg, RunLayout(WORLD, p.tp, p.pp, p.ep, p.vpp), p.cp)
    for rank in ranks:
        row = plan[dry[rank]["cp_rank"], dry[rank]["dp_rank"]][dry[rank]["pipeline_rank"]]
        planned = plan_columns(column_seconds(row["communication"], groups, cfg.cluster))
        traced = plan_columns(dry[rank]["collective_s"])
        for column in PLAN_COLUMNS:
            assert traced[column] == pytest.approx(planned[column], rel=PLAN_TOLERANCE), (rank, column)


def assert_the_same_step(got: dict, want: dict, rank: int) -> None:
    """A dry run's trace against a real run's: the same kernels, FLOPs, launches and the bytes they move, the
    roofline time they take, the collectives' waits on the timeline and so the predicted step (the same ops in
    the same order give the same figures)."""
    assert got["role"] == want["role"]
    assert got["kernels"] == want["kernels"], rank
    assert got["flops"] == want["flops"], rank
    assert got["launches_by_op"] == want["launches_by_op"], rank
    assert got["bytes_by_op"] == want["bytes_by_op"], rank
    for figure in ("compute_s", "compute_once_s", "step_s", "attended_keys", "mfu"):
        assert got[figure] == pytest.approx(want[figure], rel=1e-9), (rank, figure)
    assert got["exposed_s"] == pytest.approx(want["exposed_s"], rel=1e-9, abs=1e-15), rank


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dry_run_of_the_gpus_kernels_prices_what_a_real_run_of_them_does(tmp_path):
    """The path the dry run prices at full size: the kernels a GPU resolves (our Triton kernels, here under
    TRITON_INTERPRET in the real run, their fakes in the dry run; the grouped GEMM), tp2 x ep2 on 2 processes
    (the layouts above compare every other part with this machine's kernels). fla's chunk KDA cannot run on a
    CPU: a chunk of 16, which fla does not take, keeps both runs on the PyTorch chunk form (its pricing is checked
    against fla's own code in tests/unit/test_fla_ops.py)."""
    overrides = ["parallel.tp=2", "parallel.ep=2", "data.batch_size=2", "data.seq_len=128",  # the interpreter
                 "model.kda.chunk_size=16"]  # is slow: two short rows
    real = run_distributed(real_traces, 2, overrides, True, timeout=400)
    dry = dry_traces(tmp_path, overrides, [0], gpu_kernels=True, world=2)
    assert "Triton AttnRes mix: on" in "; ".join(f"{k}: {v}" for k, v in dry[0]["kernels"].items())
    assert_the_same_step(dry[0], real[0], 0)













def test_a_layout_the_world_cannot_hold_is_refused_in_one_line_before_any_rank_runs():
    result = subprocess.run([sys.executable, "-m", "launch.dryrun", "configs/smoke.yaml", "parallel.tp=3",
                             "--gpus", "8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 78
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert len(lines) == 1 and "parallel.tp=3" in lines[0], result.stderr
    # The assumed routing is a config key, checked against the model before any rank runs.
    result = subprocess.run([sys.executable, "-m", "launch.dryrun", "configs/smoke.yaml", "dry_run.expert_load=[1,3]",
                             "--gpus", "8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 78
    assert "dry_run.expert_load has 2 factors for model.moe.num_experts=16" in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pipeline_ranks_memory_and_once_a_step_compute_do_not_grow_with_the_steps_micro_batches(tmp_path):
    """bench/dry_run.py traces a stage's first pp micro-batches for a step of 64: right only if nothing a
    pipeline rank holds grows with the micro-batches. torch's stage kept a receive buffer per micro-batch and
    direction, and the schedule's losses kept each micro-batch's received boundary and its gradient alive
    through their graphs (training/declared_stage.py). From 2 to 4 micro-batches of the same size the last
    stage's peak may grow by the step's extra input rows, not by a boundary, and it holds no more after the step.
    Traced at 2 and 4 of them (4 holds two micro-batches in flight beyond the first 2)."""
    (tmp_path / "stage.yaml").write_text(
        "train: {steps: 4}\nstages:\n  - {name: s, tokens: 8192, seq_len: 128, batch_tokens: 2048, micro_batches: 8}\n")
    traces = {}
    for micro in (2, 4):
        out = tmp_path / f"{micro}.json"
        subprocess.run([sys.executable, "-m", "launch.dryrun", "--config", "configs/smoke.yaml", "--config",
                        str(tmp_path / "stage.yaml"), *BASE, "parallel.pp=2", "parallel.tp=2", "parallel.ep=2",
                        "--gpus", "4", "--rank", "2", "--micro-batches", str(micro), "--json", str(out)],
                       check=True, timeout=300, capture_output=True)
        (traces[micro],) = json.loads(out.read_text())
    assert traces[4]["role"] == "last stage"
    assert traces[4]["end_bytes"] == traces[2]["end_bytes"]
    boundary = traces[4]["sent_bytes"]["pp"] / 4
    assert 0 <= traces[4]["peak_bytes"] - traces[2]["peak_bytes"] < boundary / 2
    # What launch.plan --traces scales: the compute done once a step is the same at 2 and at 4 micro-batches (to
    # 1%: the step counts each micro-batch's labels before its passes, a few tiny launches), and the rest grows
    # with them (the cut step's 2 priced for 4 give the step of 4, to 1%: the micro-batches' launches are alike,
    # not identical).
    once = {micro: trace["compute_once_s"] for micro, trace in traces.items()}
    each = {micro: (trace["compute_s"] - once[micro]) / micro for micro, trace in traces.items()}
    assert 0 < once[4] == pytest.approx(once[2], rel=0.01)
    assert each[4] == pytest.approx(each[2], rel=0.01)
