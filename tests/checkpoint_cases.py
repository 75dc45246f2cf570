"""The tiny model's runs the checkpoint tests share, in one process and across layouts: STEPS steps in float64,
and the uninterrupted run a resumed one is compared with."""

from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import tiny_config

STEPS = 6


def config(run_dir, *overrides):
    return tiny_config(f"train.steps={STEPS}", "train.dtype=float64", "data.batch_size=8", "logging.progress=false",
                       f"train.run_dir={run_dir}", *overrides)


def losses_of(history):
    return [h["loss"] for h in history]


def uninterrupted_run(root) -> tuple[list[float], dict]:
    """(every step's loss, the final model's state) of the run without a stop, in root/run."""
    trainer = Trainer(config(root / "run", "train.resume=none"))
    return losses_of(run_training(trainer)), trainer.model.state_dict()
