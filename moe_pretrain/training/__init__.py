"""The training step and what it is made of: the trainer (one step), the step runner, the pipeline, the stage
switch, the step's hooks, the optimizer's groups and schedules, the run's state and its checkpoints. The job
around the steps (the run loop, its locks, watchdog, stop signals and records) is moe_pretrain/operations/."""

from moe_pretrain.training.trainer import Trainer

__all__ = ["Trainer"]
