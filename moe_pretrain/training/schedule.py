"""Where in the staged schedule a given token count falls, and the learning rate there (pure functions).

Because the stage is computed from consumed tokens alone, a resumed run (any layout, mid-stage or at a
boundary) lands in the same stage, at the same sequence length and learning rate, as an uninterrupted one.
"""

import math
from dataclasses import dataclass

from moe_pretrain.config import Config, StageConfig
from moe_pretrain.config.stage import resolve_stages


@dataclass(frozen=True)
class StagePoint:
    index: int
    stage: StageConfig
    start_tokens: int
    """Tokens consumed before this stage began."""
    tokens_into: int
    """Tokens consumed inside this stage."""
    schedule_into: int
    """Tokens consumed inside this stage's learning-rate schedule: the stage's own, or (decay run_cosine) the one
    its span of consecutive run_cosine stages shares."""
    schedule_tokens: int
    """That schedule's length in tokens."""
    schedule_warmup: int
    """Its warmup in tokens (a run_cosine span's: its first stage's)."""

    @property
    def end_tokens(self) -> int:
        return self.start_tokens + self.stage.tokens


def stage_at(stages: list[StageConfig], tokens: int) -> StagePoint:
    """The stage the next step belongs to after `tokens` consumed tokens (the last one once all are done)."""
    start = 0
    for index, stage in enumerate(stages):
        if tokens < start + stage.tokens or index == len(stages) - 1:
            first, last = _span(stages, index)
            span_start = start - sum(s.tokens for s in stages[first:index])
            return StagePoint(index, stage, start, tokens - start, tokens - span_start,
                              sum(s.tokens for s in stages[first:last + 1]), stages[first].warmup_tokens)
        start += stage.tokens
    raise ValueError("stage_at: the schedule has no stages")


def _span(stages: list[StageConfig], index: int) -> tuple[int, int]:
    """First and last index of the stages that share stage `index`'s schedule (itself unless run_cosine)."""
    first = last = index
    if stages[index].decay == "run_cosine":
        while first and stages[first - 1].decay == "run_cosine":
            first -= 1
        while last + 1 < len(stages) and stages[last + 1].decay == "run_cosine":
            last += 1
    return first, last


def stage_learning_rate(point: StagePoint) -> float:
    """LR of the step that starts at point.tokens_into: warmup, then cosine / linear / constant to lr_end (for
    run_cosine stages, the cosine their span shares)."""
    stage, t, length, warmup = point.stage, point.schedule_into, point.schedule_tokens, point.schedule_warmup
    if t < warmup:
        return stage.lr_peak * (t + stage.batch_tokens) / warmup
    span = max(length - warmup, 1)
    progress = min((t - warmup) / span, 1.0)
    if stage.decay == "constant":
        return stage.lr_peak
    if stage.decay == "linear":
        return stage.lr_peak + (stage.lr_end - stage.lr_peak) * progress
    return stage.lr_end + 0.5 * (stage.lr_peak - stage.lr_end) * (1 + math.cos(math.pi * progress))


def plan(cfg: Config) -> list[dict]:
    """One row per stage: what the run will do."""
    rows = []
    for stage in resolve_stages(cfg):
        first = stage_learning_rate(stage_at(cfg.stages, stage.start_tokens))
        last = stage_learning_rate(stage_at(cfg.stages, stage.end_tokens - stage.batch_tokens))
        rows.append({"stage": stage.name, "start_tokens": stage.start_tokens,
                     "tokens": stage.end_tokens - stage.start_tokens, "steps": stage.steps, "seq_len": stage.seq_len,
                     "batch_tokens": stage.batch_tokens, "sequences": stage.rows,
                     "micro_batches": stage.micro_batches, "lr_first": first, "lr_last": last})
    return rows
