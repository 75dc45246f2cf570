"""docs/extension.md's worked example end to end: the tiny model with plain attention layers
(tests/plain_attention.py) beside KDA and MLA trains under tensor parallelism as one process does (its
sharding-plan rows; this is also the layout tests' tp 2 alone), and the plan prices its layers as a dry run of the
layout counts them (its FLOPs and its tensor-parallel traffic)."""

import dataclasses
import multiprocessing

import pytest

from moe_pretrain.config import StageConfig, load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.planning.collective_traffic import plan_columns
from moe_pretrain.planning.dry_run import dry_run
from moe_pretrain.planning.plan_vs_dry_run import plan_of_traced_step
from moe_pretrain.planning.stage_memory import RunLayout
from tests.distributed.test_parallel_training import assert_layout_matches_single_process, train_worker
from tests.models import TINY
from tests.plain_attention import registered

PATTERN = "model.layer_pattern=KAMKAM"
TRACED = ["train.dtype=bfloat16", "data.prefetch=false", "logging.progress=false", "train.run_dir=/nonexistent",
          "parallel.tp=2", PATTERN]


def registered_train_worker(rank, world_size, run_dir, dtype, overrides):
    with registered():
        return train_worker(rank, world_size, run_dir, dtype, overrides)


@pytest.mark.timeout(300)
def test_a_new_mixer_trains_under_tensor_parallelism_as_one_process_does(tmp_path):
    with registered():
        assert_layout_matches_single_process(tmp_path, 2, [PATTERN, "parallel.tp=2"], worker=registered_train_worker)


def registered_dry_run(rank: int) -> dict:
    with registered():
        cfg = load_config("configs/smoke.yaml", [*TINY, *TRACED])
        return dataclasses.asdict(dry_run(cfg, 2, rank, gpu_kernels=False))


@pytest.mark.timeout(300)
def test_the_plan_prices_a_new_mixer_as_a_dry_run_counts_it():
    """Rank 0 of tp=2 played by the dry run (a fresh process: the fake world is its default group) against the
    plan of the same step: its FLOPs and its tensor-parallel bytes within the dry-run test's 5%."""
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        trace = pool.apply(registered_dry_run, (0,))
    with registered():
        cfg = load_config("configs/smoke.yaml", [*TINY, *TRACED])
        micro_batches, batch = resolve_stages(cfg)[0].micro_batches, cfg.data.batch_size * cfg.data.seq_len
        run = StageConfig(name="run", tokens=batch * cfg.train.steps, seq_len=cfg.data.seq_len, batch_tokens=batch,
                          micro_batches=micro_batches)  # the unstaged run as its one stage
        plan, _ = plan_of_traced_step(dataclasses.replace(cfg, stages=[run]), RunLayout(2, 2, 1, 1), 0, micro_batches,
                                      [(trace["cp_rank"], trace["dp_rank"])])
    row = plan[trace["cp_rank"], trace["dp_rank"]][trace["pipeline_rank"]]
    assert plan_columns(trace["sent_bytes"])["tp"] == pytest.approx(plan_columns(row["communication"])["tp"], rel=0.05)
    assert trace["flops"] == pytest.approx(row["flops"], rel=0.05)
