"""Short training runs of the tiny model shared by the CPU tests and their GPU counterparts (tests/gpu/)."""

from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import ParallelContext
from tests.models import tiny_config

BF16_LOSS_GAP = 0.012
"""Largest |bf16 - float32| step loss over the first 20 steps of the tiny model, nats: about twice the largest
measured over four seeds (0.0056, train.seed 0, from step 17 on; 0.0005-0.0020 for seeds 1-3)."""


def bf16_trainer(tmp_path, steps: int, dtype: str = "bfloat16", ctx: ParallelContext | None = None,
                 *overrides: str) -> Trainer:
    """The tiny model's trainer for `steps` steps in `dtype`."""
    cfg = tiny_config(f"train.steps={steps}", f"train.dtype={dtype}", f"train.run_dir={tmp_path / dtype}",
                      "logging.progress=false", *overrides)
    return Trainer(cfg, ctx)


def bf16_and_float32_losses(tmp_path, ctx: ParallelContext | None = None, *overrides: str) -> dict[str, list[float]]:
    """20 steps of the tiny model in each dtype: {dtype: step losses}."""
    return {dtype: [h["loss"] for h in run_training(bf16_trainer(tmp_path, 20, dtype, ctx, *overrides))]
            for dtype in ("float32", "bfloat16")}


def assert_bf16_tracks_float32(losses: dict[str, list[float]]) -> None:
    gaps = [abs(a - b) for a, b in zip(losses["float32"], losses["bfloat16"])]
    assert losses["float32"][-1] < losses["float32"][0] - 1.0, losses  # it trained
    assert max(gaps) <= BF16_LOSS_GAP, f"largest gap {max(gaps):.4f} at step {gaps.index(max(gaps)) + 1}: {gaps}"


def saved_inputs_training(tmp_path, policy: str, ctx: ParallelContext | None = None
              ) -> tuple[list[tuple[float, float]], dict, Trainer]:
    """Four bf16 steps of the tiny model under full recomputation with the layers' inputs kept by `policy`:
    (losses and gradient norms, the final weights, the trainer)."""
    cfg = tiny_config("train.steps=4", "train.dtype=bfloat16", "train.recompute=full",
                      f"train.saved_inputs={policy}", f"train.run_dir={tmp_path / policy}", "logging.progress=false")
    trainer = Trainer(cfg, ctx)
    history = [(h["loss"], h["grad_norm"]) for h in run_training(trainer)]
    return history, trainer.model.state_dict(), trainer
