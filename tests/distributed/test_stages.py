"""The staged context-extension scheduler end to end: transitions at exact token counts, resume across stages and
layouts, pipelines and context parallelism changing per stage (the pure schedule: tests/unit/test_schedule.py)."""

import json

import pytest

from launch.local import run_distributed
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel
from tests.models import STAGES, tiny_config

# Three stages over the tiny model: 96 -> 192 -> 384 tokens of context, 768-token batches, 2 steps each.


def staged(run_dir, *overrides):
    return tiny_config(STAGES, "train.steps=6", "train.dtype=float64", "logging.progress=false",
                       f"train.run_dir={run_dir}", *overrides)


def trace(history):
    return [(h["step"], h["stage"], h["seq_len"], h["lr"], h["loss"]) for h in history]












@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return trace(run_training(Trainer(staged(tmp_path_factory.mktemp("full") / "run", "train.resume=none"))))


def test_transitions_happen_at_exact_token_counts(uninterrupted, tmp_path):
    assert [(s, stage, seq) for s, stage, seq, _, _ in uninterrupted] == [
        (1, "s96", 96), (2, "s96", 96), (3, "s192", 192), (4, "s192", 192), (5, "s384", 384), (6, "s384", 384)]
    assert [lr for *_, lr, _ in uninterrupted][:3] == pytest.approx([0.003, 0.003, 0.003], rel=1e-12)
    run_training(Trainer(staged(tmp_path)))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept[-2:] == ["step_00000004", "step_00000006"]  # boundary checkpoints (keep_last 2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [768 * i for i in range(1, 7)]


@pytest.mark.parametrize("stop", [2, 3], ids=["at-a-boundary", "mid-stage"])
def test_resume_continues_the_same_schedule(uninterrupted, tmp_path, stop):
    first = trace(run_training(Trainer(staged(tmp_path, f"train.exit_at_step={stop}"))))
    second = trace(run_training(Trainer(staged(tmp_path))))
    assert first + second == uninterrupted  # bitwise: same stages, lengths, rates and losses


def staged_worker(rank, world_size, run_dir, overrides):
    cfg = staged(run_dir, *overrides)
    ctx = init_parallel(cfg)
    try:
        return trace(run_training(Trainer(cfg, ctx)))
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_resume_mid_stage_on_another_layout(uninterrupted, tmp_path):
    first = trace(run_training(Trainer(staged(tmp_path, "train.exit_at_step=3"))))
    second = run_distributed(staged_worker, 2, str(tmp_path), ["parallel.tp=2", "parallel.ep=2"])
    combined = first + second
    assert [row[:4] for row in combined] == [row[:4] for row in uninterrupted]
    assert [row[4] for row in combined] == pytest.approx([row[4] for row in uninterrupted], rel=1e-9)


@pytest.mark.timeout(300)
def test_pipeline_runs_the_schedule_with_a_new_boundary_shape_per_stage(uninterrupted, tmp_path):
    """pp2 rebuilds its static stage boundaries at each sequence length; resumed there mid-stage."""
    first = trace(run_training(Trainer(staged(tmp_path, "train.exit_at_step=1"))))
    two_micro = STAGES.replace("batch_tokens: 768,", "batch_tokens: 768, micro_batches: 2,")  # whole pp rounds
    second = run_distributed(staged_worker, 2, str(tmp_path), ["parallel.pp=2", two_micro])
    combined = first + second
    assert [row[:4] for row in combined] == [row[:4] for row in uninterrupted]
    assert [row[4] for row in combined] == pytest.approx([row[4] for row in uninterrupted], rel=1e-9)


@pytest.mark.timeout(300)
def test_stages_change_context_parallel_in_place(uninterrupted, tmp_path):
    """The first stage without context parallelism (dp 2), the longer two with cp 2 (dp 1), on the same two
    processes and in one run: the same stages, rates and losses as one process (1e-9, float64)."""
    per_stage = STAGES.replace("seq_len: 192,", "seq_len: 192, cp: 2,").replace("seq_len: 384,",
                                                                               "seq_len: 384, cp: 2,")
    assert per_stage.count("cp: 2") == 2
    got = run_distributed(staged_worker, 2, str(tmp_path), [per_stage, "train.resume=none"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["cp"] for r in records] == [1, 1, 2, 2, 2, 2]
    assert [row[:4] for row in got] == [row[:4] for row in uninterrupted]
    assert [row[4] for row in got] == pytest.approx([row[4] for row in uninterrupted], rel=1e-9)








def test_stage_rope_base_reaches_the_mla_layers(tmp_path):
    from moe_pretrain.model.mla import GatedMLA

    stages = STAGES.replace("lr_peak: 0.001, lr_end: 0.0001", "lr_peak: 0.001, lr_end: 0.0001, rope_theta: 500000")
    trainer = Trainer(tiny_config(stages, "train.steps=6", "model.mla.position=rope", "logging.progress=false",
                                  f"train.run_dir={tmp_path}"))
    thetas = []
    for _ in range(6):
        trainer.train_step()
        thetas.append({m.rope_theta for m in trainer.model.modules() if isinstance(m, GatedMLA)})
    assert thetas == [{10000.0}] * 4 + [{500000.0}] * 2


