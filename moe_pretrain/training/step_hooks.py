"""The step's extras: what a training step runs around the optimizer update besides the update itself.

Trainer.train_step calls every active hook at three points (and Trainer.metrics asks each for its figures), in
the order HOOK_ORDER declares: before_step (before the forward-backward), before_update (gradients reduced,
the update not yet applied) and after_update (after the update, or after the skip of a step whose loss or
gradient norm is not finite). A hook sees what its StepContext gives it, never the trainer: the model, the
optimizer, this rank's place in the layout. A hook that carries state across steps returns it from
state_dict, and the run's checkpoints keep it (training/state.py) and hand it back through load_state_dict.

A new per-step update is a StepHook here, its name in HOOK_ORDER and a line in step_hooks (or, for the job's
own, Trainer.add_hook from the run loop: operations/stragglers.py); the step itself does not change.
(torchtitan hangs such updates on the optimizer as step hooks; ours also need the skip decision.)
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_pretrain.config import Config
from moe_pretrain.fp8 import RECIPES, advance_amax_histories
from moe_pretrain.model.qk_clip import clip_heads, start_recording
from parallel.collectives import all_reduce_max
from parallel.optimizer import ShardedOptimizer
from parallel.state import ParallelContext

HOOK_ORDER = ("save_fence", "qk_clip", "amax_histories", "straggler_windows", "balancing")
"""The order the hooks run in at every point. The save fence comes first: a background save's copy must be
complete before any hook or the update changes a tensor. QK-clip scales the updated weights before the
balancers move the routers' biases, which read none of them; the FP8 histories close the step whatever it
did; the straggler check only reads the step's figures."""


@dataclass(frozen=True)
class StepContext:
    """What a hook may read and act on: this rank's model (its parameters, modules and buffers), its optimizer
    (to finish the parameter gathers before touching a weight, and to scale rows of one with its shards) and
    its place in the layout (groups, device)."""

    model: nn.Module
    optimizer: ShardedOptimizer
    parallel: ParallelContext


class StepHook:
    """Does nothing at every point and keeps no state; a hook overrides what it acts at."""

    name = ""
    """Its entry in HOOK_ORDER, and its key in a checkpoint's hook states."""

    def before_step(self) -> None:
        pass

    def before_update(self) -> None:
        pass

    def after_update(self, skipped: bool) -> None:
        pass

    def metrics(self, step: int) -> dict[str, float]:
        """What the hook adds to the record of step `step` (collective where it reduces: every rank calls it)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the hook carries from step to step (JSON values), for the run's checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what state_dict gave, from a checkpoint of this run."""


class QKClip(StepHook):
    """optim.qk_clip_threshold (model/qk_clip.py): the MLA layers record their heads' largest logits during
    the step; after the update the heads over the threshold are scaled, on the maxima reduced over the data x
    context parallel ranks (each saw its own rows and positions)."""

    name = "qk_clip"

    def __init__(self, step: StepContext, threshold: float):
        self.step, self.threshold = step, threshold
        self.max_logits: torch.Tensor | None = None
        """The last step's maxima, this rank's MLA layers x heads (None: no MLA layer here)."""

    def before_step(self) -> None:
        start_recording(self.step.model)

    def after_update(self, skipped: bool) -> None:
        if skipped:
            return
        self.step.optimizer.finish_parameter_gathers()  # the clip scales the parameters every rank holds
        group = self.step.parallel.dp_group
        self.max_logits = clip_heads(self.step.model, self.threshold, lambda m: all_reduce_max(m, group),
                                     self.step.optimizer.scale_rows)

    def metrics(self, step: int) -> dict[str, float]:
        """The step's largest MLA attention logit over every layer and head (before the clip): a maximum over all
        ranks (a stage without MLA layers gives -inf)."""
        local = self.max_logits.max() if self.max_logits is not None else torch.tensor(float("-inf"))
        parallel = self.step.parallel
        group = dist.group.WORLD if parallel.distributed else None
        return {"max_logit": all_reduce_max(local.reshape(1).to(parallel.device, torch.float64), group).item()}


class AmaxHistories(StepHook):
    """precision.fp8=delayed: close the step for every amax history, reduced over the expert-data-parallel ranks
    (which hold the same experts); a skipped step records nothing, so no inf reaches a scale."""

    name = "amax_histories"

    def __init__(self, step: StepContext):
        self.step = step

    def after_update(self, skipped: bool) -> None:
        parallel = self.step.parallel
        advance_amax_histories(self.step.model, parallel.edp_group if parallel.distributed else None,
                               discard=skipped)


class Balancing(StepHook):
    """The routers' biases move by their balancers after each update; a skipped step's statistics are dropped."""

    name = "balancing"

    def __init__(self, model: nn.Module):
        self.model = model

    def after_update(self, skipped: bool) -> None:
        if skipped:
            self.model.discard_balancing()
        else:
            self.model.update_balancing()


class SaveFence(StepHook):
    """checkpoint.async_save: a background save's copy of the state must be complete before the update
    changes the state."""

    name = "save_fence"

    def __init__(self, saver):
        self.saver = saver

    def before_update(self) -> None:
        self.saver.before_update()


def step_hooks(cfg: Config, step: StepContext, saver) -> list[StepHook]:
    """The training hooks the config turns on, appended in HOOK_ORDER (the job's own, the straggler check, the run
    loop adds: Trainer.add_hook). saver: checkpoint.async_save's saver (None without)."""
    hooks: list[StepHook] = []
    if saver is not None:
        hooks.append(SaveFence(saver))
    if cfg.optim.qk_clip_threshold:
        hooks.append(QKClip(step, cfg.optim.qk_clip_threshold))
    if cfg.precision.fp8 != "off" and RECIPES[cfg.precision.fp8].delayed:  # only delayed scaling keeps histories
        hooks.append(AmaxHistories(step))
    hooks.append(Balancing(step.model))
    return hooks


def in_order(hooks: list[StepHook]) -> list[StepHook]:
    """hooks sorted by HOOK_ORDER (a hook whose name it lacks is refused: its place would be a guess)."""
    unknown = [hook.name for hook in hooks if hook.name not in HOOK_ORDER]
    if unknown:
        raise ValueError(f"step hooks {unknown} have no place in training/step_hooks.HOOK_ORDER")
    return sorted(hooks, key=lambda hook: HOOK_ORDER.index(hook.name))
