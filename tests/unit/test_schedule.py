"""The staged schedule as pure functions: the stage of a token count, the learning rate's segments, and the
schedules refused with their keys named."""

import math
import re

import pytest

from moe_pretrain.config import ConfigError, StageConfig, load_config
from moe_pretrain.training.schedule import stage_at, stage_learning_rate
from tests.models import STAGES, tiny_config


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


def test_full_schedule_validates_on_its_stated_layout():
    from moe_pretrain.config import load_config
    from parallel.state import resolve_layout

    cfg = load_config(["configs/full.yaml", "configs/stages/full.yaml"])
    layout = resolve_layout(cfg, 2048)
    assert (layout.tp, layout.pp, layout.ep) == (4, 4, 128)
    assert cfg.parallel.pipeline_layers == [22, 25, 25, 21]  # the first holds the tower, the last the MTP block
    assert [stage.cp for stage in cfg.stages] == [1, 8, 32, 128]
    assert [stage.micro_batches for stage in cfg.stages] == [64, 64, 64, 64]
