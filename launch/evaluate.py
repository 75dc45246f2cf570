"""Evaluate a checkpoint on demand, one process or many (torchrun), as training does at a stage's end:

    python -m launch.evaluate --config CONFIG RUN/checkpoints/step_00000004 [key=value ...]

The held-out loss per dataset (eval section; eval.tokens must be set), the loss by position bucket on the
longest held-out documents and the pass-key retrieval probe, all at the sequence length of the stage the
checkpoint's last step belonged to. The record is printed as one JSON line and
appended to <train.run_dir>/evaluations.jsonl, which `python -m launch.report` plots.
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from moe_pretrain.checkpoint import find, verifying_load
from moe_pretrain.checkpoint.manifest import MANIFEST
from moe_pretrain.config import ConfigError, add_config_arguments, load_config_from_args
from moe_pretrain.log import setup_logging
from moe_pretrain.training import Trainer
from moe_pretrain.training.evaluation import evaluate, evaluate_long_context
from parallel.state import destroy_parallel, init_parallel

log = logging.getLogger("launch.evaluate")

EVALUATIONS = "evaluations.jsonl"
CONFIG_SUFFIXES = (".yaml", ".yml")


def evaluate_checkpoint(trainer: Trainer, checkpoint: Path) -> dict:
    """Load `checkpoint` (verified while loading) and evaluate it at its last step's stage (collective). Each
    phase is announced as it starts and timed as it ends: on a busy machine the whole takes many minutes."""
    start = time.perf_counter()
    log.info(f"evaluate: verifying and loading {checkpoint}")
    loader = verifying_load(trainer.state.load, trainer.state.checkpoint_group)
    found, _ = find(checkpoint.parent, str(checkpoint), loader)
    if found is None:
        raise ConfigError(f"{checkpoint}: nothing to evaluate")
    step, tokens = trainer.step, trainer.tokens_seen
    stage = trainer.step_plan(max(step - 1, 0), max(tokens - 1, 0)).stage  # the checkpoint's last step's
    record = {"checkpoint": str(checkpoint), "step": step, "tokens": tokens, "stage": stage.name,
              "seq_len": stage.seq_len}
    phases = [("held-out loss", evaluate), ("loss by position and the retrieval probe", evaluate_long_context)]
    for number, (name, phase) in enumerate(phases, 1):
        log.info(f"evaluate: step {step} ({stage.name}, seq_len {stage.seq_len}): {number}/{len(phases)} {name} "
                 f"({time.perf_counter() - start:.0f} s so far)")
        record.update(phase(trainer.runner, trainer.validation, stage))
    log.info(f"evaluate: done in {time.perf_counter() - start:.0f} s")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.evaluate", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--checkpoint", type=Path, help="a step_<N> checkpoint directory (or give it positionally)")
    args = parser.parse_args(argv)
    if args.checkpoint is None:  # the positional path among the config files and overrides
        paths = [item for item in args.config_items if "=" not in item and Path(item).suffix not in CONFIG_SUFFIXES]
        if len(paths) != 1:
            parser.error("give the checkpoint to evaluate: a step_<N> directory, positionally or as --checkpoint"
                         + (f" (got {len(paths)}: {', '.join(paths)})" if paths else ""))
        args.checkpoint = Path(paths[0])
        args.config_items.remove(paths[0])
    if not args.checkpoint.is_dir():
        parser.error(f"checkpoint {args.checkpoint} does not exist" if not args.checkpoint.exists()
                     else f"checkpoint {args.checkpoint} is not a directory")
    if not (args.checkpoint / MANIFEST).is_file():
        parser.error(f"{args.checkpoint} is not a checkpoint: no {MANIFEST} (give a step_<N> directory that "
                     "committed)")
    setup_logging(0)
    cfg = load_config_from_args(args)
    if not cfg.eval.enabled:
        print("launch.evaluate: set eval.tokens (held-out tokens per dataset) to evaluate", file=sys.stderr)
        return 2
    ctx = init_parallel(cfg)
    try:
        log.info("evaluate: building the model and reading the held-out data")
        trainer = Trainer(cfg, ctx)
        record = evaluate_checkpoint(trainer, args.checkpoint)
        if ctx.is_logging_rank:
            print(json.dumps(record))
            run_dir = Path(cfg.train.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            with (run_dir / EVALUATIONS).open("a") as f:
                f.write(json.dumps(record) + "\n")
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
