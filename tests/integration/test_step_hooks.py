"""The step's extras (training/step_hooks.py): assembled in the declared order, called at their points in that
order by a real step, and a hook's state kept by the run's checkpoints and handed back on resume."""

import pytest
from torch import nn

from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.operations.stragglers import straggler_windows
from moe_pretrain.training import Trainer
from moe_pretrain.training.step_hooks import HOOK_ORDER, StepContext, StepHook, in_order, step_hooks
from moe_pretrain.training.step_telemetry import StepTelemetry
from parallel.state import ParallelContext
from tests.models import EVAL_OFF, tiny_config

RUN = ["train.dtype=float64", "logging.progress=false", *EVAL_OFF]


def test_every_hook_turned_on_is_assembled_in_the_declared_order(tmp_path):
    """The training hooks, then the job's straggler check added in its place; a hook without one is refused."""
    cfg = tiny_config("optim.qk_clip_threshold=100", "precision.fp8=delayed", "logging.straggler.every=2",
                      "parallel.ranks_per_node=1", f"train.run_dir={tmp_path}")
    ctx, model = ParallelContext.single(), nn.Module()
    step = StepContext(model, None, ctx)
    hooks = step_hooks(cfg, step, saver=object())
    assert [hook.name for hook in hooks] == [name for name in HOOK_ORDER if name != "straggler_windows"]
    windows = straggler_windows(cfg, ctx, StepTelemetry(ctx, model, on=True))
    assert [hook.name for hook in in_order([windows, *hooks])] == list(HOOK_ORDER)
    assert [hook.name for hook in step_hooks(tiny_config(), step, saver=None)] == ["balancing"]
    assert straggler_windows(cfg, ctx, StepTelemetry(ctx, model, on=False)) is None
    with pytest.raises(ValueError, match=r"step hooks \['unplaced'\] have no place"):
        in_order([*hooks, Recorder("unplaced", [])])


class Recorder(StepHook):
    """Writes each call into a shared log, and counts its updates as its state."""

    def __init__(self, name: str, calls: list[str]):
        self.name, self.calls, self.updates = name, calls, 0

    def before_step(self) -> None:
        self.calls.append(f"{self.name}.before_step")

    def before_update(self) -> None:
        self.calls.append(f"{self.name}.before_update")

    def after_update(self, skipped: bool) -> None:
        self.calls.append(f"{self.name}.after_update")
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]


@pytest.mark.timeout(120)
def test_a_step_calls_its_hooks_point_by_point_in_order_and_a_resume_gives_back_their_state(tmp_path):
    calls: list[str] = []
    overrides = [*RUN, "train.steps=3", "checkpoint.every=1", f"train.run_dir={tmp_path}"]
    trainer = Trainer(tiny_config(*overrides, "train.exit_at_step=2"))
    trainer.checkpoints.hooks = [Recorder("a", calls), Recorder("b", calls)]
    run_training(trainer)
    points = ["before_step", "before_update", "after_update"]
    assert calls == 2 * [f"{name}.{point}" for point in points for name in "ab"]

    resumed = Trainer(tiny_config(*overrides))
    resumed.checkpoints.hooks = [Recorder("a", []), Recorder("b", [])]
    assert len(run_training(resumed)) == 1  # resumed at step 2, one step to go
    assert [hook.updates for hook in resumed.hooks] == [3, 3]
