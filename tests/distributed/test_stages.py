"""The staged context-extension scheduler: pure schedule, invalid schedules, and end-to-end runs with resume."""

import json
import math
import re

import pytest

from launch.local import run_distributed
from moe_pretrain.config import ConfigError, StageConfig, load_config
from moe_pretrain.training import Trainer
from moe_pretrain.training.schedule import stage_at, stage_learning_rate
from parallel.state import destroy_parallel, init_parallel
from tests.models import STAGES, tiny_config

# Three stages over the tiny model: 96 -> 192 -> 384 tokens of context, 768-token batches, 2 steps each.


def staged(run_dir, *overrides):
    return tiny_config(STAGES, "train.steps=6", "train.dtype=float64", "logging.progress=false",
                       f"train.run_dir={run_dir}", *overrides)


def trace(history):
    return [(h["step"], h["stage"], h["seq_len"], h["lr"], h["loss"]) for h in history]


def test_stage_is_a_pure_function_of_tokens():
    stages = [StageConfig("a", 100, 10, 20), StageConfig("b", 60, 20, 20)]
    assert [stage_at(stages, t).stage.name for t in (0, 99, 100, 159, 160)] == ["a", "a", "b", "b", "b"]
    point = stage_at(stages, 120)
    assert (point.index, point.start_tokens, point.tokens_into, point.end_tokens) == (1, 100, 20, 160)


def test_learning_rate_segments():
    cosine = StageConfig("c", 1000, 10, 100, lr_peak=1.0, lr_end=0.1, warmup_tokens=200, decay="cosine")
    lrs = [stage_learning_rate(stage_at([cosine], t)) for t in range(0, 1000, 100)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.875)))
    linear = StageConfig("l", 400, 10, 100, lr_peak=1.0, lr_end=0.0, decay="linear")
    assert [stage_learning_rate(stage_at([linear], t)) for t in (0, 100, 300)] == [1.0, 0.75, 0.25]


def test_run_cosine_stages_cut_one_schedule_without_restarting_it():
    """Three run_cosine stages (the middle one without a warmup of its own) give exactly the learning rates of one
    cosine stage over all their tokens; a stage after the span has its own schedule again."""
    shared = dict(lr_peak=1.0, lr_end=0.1, decay="run_cosine")
    stages = [StageConfig("a", 500, 10, 100, warmup_tokens=100, **shared), StageConfig("b", 300, 20, 100, **shared),
              StageConfig("c", 200, 40, 100, **shared),
              StageConfig("d", 200, 80, 100, lr_peak=0.05, lr_end=0.0, decay="linear")]
    one = [StageConfig("one", 1000, 10, 100, lr_peak=1.0, lr_end=0.1, warmup_tokens=100, decay="cosine")]
    got = [stage_learning_rate(stage_at(stages, t)) for t in range(0, 1000, 100)]
    assert got == pytest.approx([stage_learning_rate(stage_at(one, t)) for t in range(0, 1000, 100)], rel=1e-15)
    assert got[5] < 1.0  # stage b starts where the cosine is, not at lr_peak
    assert [stage_learning_rate(stage_at(stages, t)) for t in (1000, 1100)] == [0.05, 0.025]


@pytest.mark.parametrize(("stages", "message"), [
    ("[{tokens: 100, seq_len: 10, batch_tokens: 25}]", "stages[0].batch_tokens=25 is not a multiple of"),
    ("[{tokens: 150, seq_len: 10, batch_tokens: 100}]", "stages[0].tokens=150 is not a whole number of"),
    ("[{tokens: 100, seq_len: 20, batch_tokens: 100}, {tokens: 100, seq_len: 20, batch_tokens: 100}]",
     "stages[1].seq_len=20 must be larger than stages[0].seq_len=20"),
    ("[{tokens: 100, seq_len: 10, batch_tokens: 100, micro_batches: 3}]", "not divisible by stages[0].micro_batches=3"),
    ("[{tokens: 100, seq_len: 10, batch_tokens: 100, lr_peak: 0.1, lr_end: 0.2}]", "stages[0].lr_end=0.2"),
    ("[{tokens: 100, seq_len: 10, batch_tokens: 100, nope: 1}]", "unknown config key stages[0].nope"),
    ("[{tokens: 100, seq_len: 10, batch_tokens: 100, decay: run_cosine}, "
     "{tokens: 100, seq_len: 20, batch_tokens: 100, decay: run_cosine, lr_peak: 0.1}]",
     "stages[1].lr_peak=0.1 differs from stages[0].lr_peak=0.0003: consecutive run_cosine stages share one"),
    ("[{tokens: 100, seq_len: 10, batch_tokens: 100, decay: run_cosine}, "
     "{tokens: 100, seq_len: 20, batch_tokens: 100, decay: run_cosine, warmup_tokens: 50}]",
     "stages[1].warmup_tokens=50: a run_cosine stage that continues the schedule has no warmup"),
])
def test_invalid_schedules_fail_clearly(stages, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/smoke.yaml", [f"stages={stages}", "train.steps=1"])


def test_train_steps_must_match_the_schedule():
    with pytest.raises(ConfigError, match=re.escape("train.steps=5 disagrees with the stages, which make 6 steps")):
        tiny_config(STAGES, "train.steps=5")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return trace(Trainer(staged(tmp_path_factory.mktemp("full") / "run", "train.resume=none")).run())


def test_transitions_happen_at_exact_token_counts(uninterrupted, tmp_path):
    assert [(s, stage, seq) for s, stage, seq, _, _ in uninterrupted] == [
        (1, "s96", 96), (2, "s96", 96), (3, "s192", 192), (4, "s192", 192), (5, "s384", 384), (6, "s384", 384)]
    assert [lr for *_, lr, _ in uninterrupted][:3] == pytest.approx([0.003, 0.003, 0.003], rel=1e-12)
    Trainer(staged(tmp_path)).run()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept[-2:] == ["step_00000004", "step_00000006"]  # boundary checkpoints (keep_last 2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [768 * i for i in range(1, 7)]


@pytest.mark.parametrize("stop", [2, 3], ids=["at-a-boundary", "mid-stage"])
def test_resume_continues_the_same_schedule(uninterrupted, tmp_path, stop):
    first = trace(Trainer(staged(tmp_path, f"train.exit_at_step={stop}")).run())
    second = trace(Trainer(staged(tmp_path)).run())
    assert first + second == uninterrupted  # bitwise: same stages, lengths, rates and losses


def staged_worker(rank, world_size, run_dir, overrides):
    cfg = staged(run_dir, *overrides)
    ctx = init_parallel(cfg)
    try:
        return trace(Trainer(cfg, ctx).run())
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_resume_mid_stage_on_another_layout(uninterrupted, tmp_path):
    first = trace(Trainer(staged(tmp_path, "train.exit_at_step=3")).run())
    second = run_distributed(staged_worker, 2, str(tmp_path), ["parallel.tp=2", "parallel.ep=2"])
    combined = first + second
    assert [row[:4] for row in combined] == [row[:4] for row in uninterrupted]
    assert [row[4] for row in combined] == pytest.approx([row[4] for row in uninterrupted], rel=1e-9)


@pytest.mark.timeout(300)
def test_pipeline_runs_the_schedule_with_a_new_boundary_shape_per_stage(uninterrupted, tmp_path):
    """pp2 rebuilds its static stage boundaries at each sequence length; resumed there mid-stage."""
    first = trace(Trainer(staged(tmp_path, "train.exit_at_step=1")).run())
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


@pytest.mark.timeout(120)
def test_plan_prints_the_schedule_and_its_memory(capsys):
    """The full-size schedule on its stated layout (configs/stages/full.yaml: 2048 H200, tp 4 x pp 4, MLA's
    latent exchange under cp): every stage valid and fitting, 1M included (it did not with Ulysses' cap). With
    the weights' bf16 copies and the gradient shards counted (issue 40; the plan then agreed with the 8K dry
    run within 2%), the longer stages needed twice the cp and micro-batches, and every stage keeps 8% of the
    GPU, not the 10% --propose asks for: the layout is to be re-chosen (configs/stages/full.yaml)."""
    from launch.plan import main

    code = main(["--config", "configs/full.yaml", "--config", "configs/stages/full.yaml", "--gpus", "2048"])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("8k", "64k", "256k", "1m"):
        assert f"\n{name} " in out
    assert "days" in out and "231250" in out
    memory = out.split("memory per GPU")[1]
    verdicts = {line.split()[0]: line.split("|")[0].split()[-1] for line in memory.splitlines()[2:] if "|" in line}
    assert verdicts == {"8k": "yes", "64k": "yes", "256k": "yes", "1m": "yes"}, memory
    assert "\n1m       cp=128 latent full M=64 " in memory
    assert memory.splitlines()[1].split("|")[0].split()[-3:] == ["total", "host", "fits"]
    totals = [float(line.split("|")[0].split()[-3]) for line in memory.splitlines()[2:] if "|" in line]
    assert len(totals) == 4 and max(totals) <= 0.92 * 141, memory
    # Days from the plan's step-time model (no assumed MFU): every stage priced, the total their sum.
    times = out.split("step time on 2048 x h200")[1].splitlines()
    rows = {line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:4]] for line in times[2:6]}
    assert list(rows) == ["8k", "64k", "256k", "1m"] and all(step > 0 and 0 < mfu < 100 for step, mfu, _ in
                                                               rows.values()), times
    total = float(times[6].split("total days: ")[1].split()[0])
    assert total == pytest.approx(sum(days for _, _, days in rows.values()), abs=0.2)
    assert times[7].startswith("verdict: fits: every stage within 141 GB a GPU")


@pytest.mark.timeout(120)
def test_plan_proposes_a_layout_per_stage(capsys):
    """The smoke schedule on 8 GPUs of 0.2 GB: the longer stage takes cp 2 (Ulysses: the smoke model's 2
    MLA heads divide); the longest has 2 sequences per batch, so it needs cp 4, beyond the heads: the
    latent exchange (before it, the heads' cap left that stage with no layout)."""
    from launch.plan import main

    code = main(["--config", "configs/smoke.yaml", "--config", "configs/stages/tiny.yaml", "--gpus", "8",
                 "--gpu-gb", "0.2", "--propose"])
    out = capsys.readouterr().out
    assert code == 0, out
    proposal = out.split("proposed: ")[1]
    assert proposal.startswith("tp=1 pp=1 ep=8")
    assert "\nctx512   cp=2 none M=1 " in proposal
    assert "\nctx1024  cp=4 latent none M=1 " in proposal


def test_full_schedule_validates_on_its_stated_layout():
    from moe_pretrain.config import load_config
    from parallel.state import resolve_layout

    cfg = load_config(["configs/full.yaml", "configs/stages/full.yaml"])
    layout = resolve_layout(cfg, 2048)
    assert (layout.tp, layout.pp, layout.ep) == (4, 4, 128)
    assert cfg.parallel.pipeline_layers == [22, 25, 25, 21]  # the first holds the tower, the last the MTP block
    assert [stage.cp for stage in cfg.stages] == [1, 8, 32, 128]
    assert [stage.micro_batches for stage in cfg.stages] == [64, 64, 64, 64]


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


@pytest.mark.timeout(120)
def test_plan_moves_the_saved_inputs_where_the_stage_says(monkeypatch):
    """The full-size 1m stage on its layout with the layers' inputs on the device, the host and in FP8: the
    host policy moves them off the GPU (but its prefetch window), FP8 keeps 1 + 4 / 128 bytes a value for
    bf16's 2, and a stage whose offloaded inputs exceed the node's host memory does not fit."""
    from dataclasses import replace

    from moe_pretrain.config import load_config
    from moe_pretrain.config.stage import resolve_stages
    from moe_pretrain.gpus import GPUS
    from moe_pretrain.planning import stage_memory
    from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout

    cfg = load_config(["configs/full.yaml", "configs/stages/full.yaml"])
    planner, run = MemoryPlanner(cfg), RunLayout(2048, 4, 4, 128)
    stage = resolve_stages(cfg)[3]
    # One pipeline rank under every policy (the first: the most micro-batches in flight); the worst rank may
    # differ between policies.
    first = {policy: planner.stage(run, replace(stage, saved_inputs=policy))["first"]
             for policy in ("device", "host", "fp8")}
    device, host, fp8 = first["device"], first["host"], first["fp8"]
    moved = host["host_bytes"]
    assert device["host_bytes"] == fp8["host_bytes"] == 0 and moved > 0
    # The host policy frees what it moved but its prefetch window of layers' inputs (kept on the device).
    assert 0 < device["total_bytes"] - host["total_bytes"] < moved
    assert device["total_bytes"] - fp8["total_bytes"] == pytest.approx(moved * (1 - (1 + 4 / 128) / 2), rel=1e-9)
    gpu = GPUS["h200"].memory_bytes
    assert planner.fits(run, replace(stage, saved_inputs="host"), gpu) is not None
    monkeypatch.setattr(stage_memory, "HOST_BYTES_PER_GPU", moved / 2)
    assert planner.fits(run, replace(stage, saved_inputs="host"), gpu) is None
