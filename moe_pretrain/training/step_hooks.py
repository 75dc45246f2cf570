"""The step's extras: what a training step runs around the optimizer update besides the update itself.

Trainer.train_step calls every active hook at three points (and Trainer.metrics asks each for its figures), in
the order step_hooks lists them: before_step (before the forward-backward), before_update (gradients reduced,
the update not yet applied) and after_update (after the update, or after the skip of a step whose loss or
gradient norm is not finite).
A new per-step update is a StepHook here and one line in step_hooks; the step itself does not change.
(torchtitan hangs such updates on the optimizer as step hooks; ours also need the skip decision.)
"""

import torch
import torch.distributed as dist

from moe_pretrain.fp8 import RECIPES, advance_amax_histories
from moe_pretrain.model.qk_clip import clip_heads, start_recording
from parallel.collectives import all_reduce_max
from parallel.state import ranks_per_node
from parallel.stragglers import StragglerCheck


class StepHook:
    """Does nothing at every point; a hook overrides the points it acts at."""

    def before_step(self) -> None:
        pass

    def before_update(self) -> None:
        pass

    def after_update(self, skipped: bool) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """What the hook adds to the step's record (collective where it reduces: every rank calls it)."""
        return {}


class QKClip(StepHook):
    """optim.qk_clip_threshold (model/qk_clip.py): the MLA layers record their heads' largest logits during
    the step; after the update the heads over the threshold are scaled, on the maxima reduced over the data x
    context parallel ranks (each saw its own rows and positions)."""

    def __init__(self, trainer, threshold: float):
        self.trainer, self.threshold = trainer, threshold
        self.max_logits: torch.Tensor | None = None
        """The last step's maxima, this rank's MLA layers x heads (None: no MLA layer here)."""

    def before_step(self) -> None:
        start_recording(self.trainer.model)

    def after_update(self, skipped: bool) -> None:
        if skipped:
            return
        self.trainer.optimizer.finish_parameter_gathers()  # the clip scales the parameters every rank holds
        group = self.trainer.ctx.dp_group
        self.max_logits = clip_heads(self.trainer.model, self.threshold, lambda m: all_reduce_max(m, group),
                                     self.trainer.optimizer.scale_rows)

    def metrics(self) -> dict[str, float]:
        """The step's largest MLA attention logit over every layer and head (before the clip): a maximum over all
        ranks (a stage without MLA layers gives -inf)."""
        local = self.max_logits.max() if self.max_logits is not None else torch.tensor(float("-inf"))
        ctx = self.trainer.ctx
        group = dist.group.WORLD if ctx.distributed else None
        return {"max_logit": all_reduce_max(local.reshape(1).to(self.trainer.device, torch.float64), group).item()}


class AmaxHistories(StepHook):
    """precision.fp8=delayed: close the step for every amax history, reduced over the expert-data-parallel ranks
    (which hold the same experts); a skipped step records nothing, so no inf reaches a scale."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_update(self, skipped: bool) -> None:
        ctx = self.trainer.ctx
        advance_amax_histories(self.trainer.model, ctx.edp_group if ctx.distributed else None, discard=skipped)


class Balancing(StepHook):
    """The routers' biases move by their balancers after each update; a skipped step's statistics are dropped."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_update(self, skipped: bool) -> None:
        if skipped:
            self.trainer.model.discard_balancing()
        else:
            self.trainer.model.update_balancing()


class SaveFence(StepHook):
    """checkpoint.async_save: a background save's copy of the state must be complete before the update
    changes the state."""

    def __init__(self, saver):
        self.saver = saver

    def before_update(self) -> None:
        self.saver.before_update()


class StragglerWindows(StepHook):
    """logging.straggler: at the end of every window of logging.straggler.every steps, the ranks' figures (the
    trainer's step telemetry) judged together (parallel/stragglers.py; its one all-gather: every rank calls
    metrics every step); the step's record gets what it found."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        straggler = cfg.logging.straggler
        self.trainer, self.every = trainer, straggler.every
        self.check = StragglerCheck(trainer.ctx, ranks_per_node(cfg), straggler.threshold, straggler.windows,
                                    cfg.train.run_dir, mark=straggler.action == "exclude")

    def metrics(self) -> dict[str, float]:
        step = self.trainer.step
        return self.check.check(step, self.trainer.telemetry.take()) if step % self.every == 0 else {}


def step_hooks(trainer) -> list[StepHook]:
    """The hooks the trainer's config turns on, in the order they run at each point."""
    cfg, hooks = trainer.cfg, []
    if trainer.checkpoints.async_saver is not None:
        hooks.append(SaveFence(trainer.checkpoints.async_saver))
    if cfg.optim.qk_clip_threshold:
        hooks.append(QKClip(trainer, cfg.optim.qk_clip_threshold))
    if cfg.precision.fp8 != "off" and RECIPES[cfg.precision.fp8].delayed:  # only delayed scaling keeps histories
        hooks.append(AmaxHistories(trainer))
    if trainer.telemetry.on:
        hooks.append(StragglerWindows(trainer))
    return [*hooks, Balancing(trainer)]
