"""The run: train to train.steps (or train.exit_at_step), resuming per train.resume, evaluating, saving
checkpoints at intervals, stage ends and on an agreed stop signal, and writing the run directory's records.

The trainer (training/trainer.py) does one step; this is the loop around it, with what a run must never lose: a
relaunch of a finished run does nothing, a restart before the first checkpoint keeps the earlier attempt's
metrics aside, a run directory holding another run's metrics is refused, and a stop signal saves first.
"""

import logging
import time
from pathlib import Path

import torch.distributed as dist
import yaml

from moe_pretrain import checkpoint
from moe_pretrain.config import ConfigError, config_to_dict
from moe_pretrain.operations.metrics import MetricsWriter, ProgressBar
from moe_pretrain.operations.outcome import Preempted
from moe_pretrain.operations.preemption import StopSignals, stop_at_from_env
from moe_pretrain.operations.stragglers import straggler_windows
from moe_pretrain.operations.wandb_run import check_wandb, open_wandb_run
from moe_pretrain.operations.watchdog import StepWatchdog
from moe_pretrain.training import Trainer
from parallel.collectives import barrier

log = logging.getLogger(__name__)


def run_training(trainer: Trainer) -> list[dict]:
    """Train to train.steps (or train.exit_at_step), resuming per train.resume and saving checkpoints;
    rank 0 writes run_dir/config.yaml and run_dir/metrics.jsonl. Returns the steps' records: empty
    when the resumed checkpoint is already at the end (a relaunch of a finished run)."""
    cfg, ctx = trainer.cfg, trainer.ctx
    check_wandb(cfg)
    if (windows := straggler_windows(cfg, ctx, trainer.telemetry)) is not None:
        trainer.add_hook(windows)  # before the resume, which hands the hooks their states
    run_dir = Path(cfg.train.run_dir)
    checkpoints = trainer.checkpoints
    resumed = checkpoints.resume() is not None
    config_text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    restarted = not resumed and (run_dir / "metrics.jsonl").exists()
    if restarted and not _same_run(run_dir, config_text, cfg.train.resume):
        raise ConfigError(f"train.run_dir={run_dir} already holds metrics.jsonl from an earlier run and no "
                          "checkpoint to resume; choose another train.run_dir (nothing was overwritten)")
    stop = cfg.train.exit_at_step or cfg.train.steps
    if trainer.step >= stop:
        end = "train.steps" if stop == cfg.train.steps else "train.exit_at_step"
        log.info(f"run already finished at step {trainer.step} ({end}={stop}); nothing to do")
        return []
    if ctx.distributed:
        barrier(dist.group.WORLD)  # every rank has checked before rank 0 creates anything
    writer = None
    if ctx.is_logging_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
        if restarted:
            kept = _keep_aside(run_dir / "metrics.jsonl")
            log.warning(f"no checkpoint yet in {run_dir}: this restart of the same run (its config.yaml is "
                        f"this config) starts over; the earlier attempt's metrics are kept in {kept}")
        (run_dir / "config.yaml").write_text(config_text)
        writer = MetricsWriter(run_dir / "metrics.jsonl", resuming=resumed, tensorboard=cfg.logging.tensorboard,
                               wandb_run=open_wandb_run(cfg, run_dir))
    bar = ProgressBar(cfg.train.steps, cfg.logging.log_every, cfg.logging.progress and ctx.is_logging_rank)
    history = []
    saved_at = trainer.step if resumed else -1
    signals = StopSignals(stop_at_from_env())
    save_interval_s = cfg.checkpoint.every_minutes * 60
    last_save_time = time.monotonic()
    t = cfg.train
    watchdog = StepWatchdog(run_dir, ctx.rank, t.hang_multiple, t.hang_min_s, t.hang_timeout_s)
    stage = None
    try:
        while trainer.step < stop:
            plan = trainer.step_plan()
            if plan.stage != stage:
                stage = plan.stage
                watchdog.new_stage()
            watchdog.begin(trainer.step + 1)
            result = trainer.train_step()
            watchdog.end()
            record = trainer.metrics(result)
            at_boundary = trainer.tokens_seen == stage.end_tokens
            if _evaluation_due(trainer, at_boundary):
                record.update(trainer.evaluate(stage, long_context=cfg.eval.long_context and (
                    at_boundary or trainer.step == cfg.train.steps)))
            if writer is not None:
                writer.write(record)
            history.append(record)
            bar.update(trainer.step - 1, result.loss, record["tokens_per_s"], result.lr, record.get("eval_loss"))
            checkpoints.poll()
            time_due = bool(save_interval_s) and time.monotonic() - last_save_time >= save_interval_s
            agreed = signals.agreed(ctx.distributed, ctx.device, save_due=time_due,
                                    next_step_s=result.seconds)
            at_interval = bool(cfg.checkpoint.every) and trainer.step % cfg.checkpoint.every == 0
            if at_boundary or at_interval or agreed.save_due:
                checkpoints.save()
                saved_at, last_save_time = trainer.step, time.monotonic()
            if agreed.signal_name and trainer.step < stop:
                if saved_at != trainer.step:
                    checkpoints.save()
                checkpoints.wait()
                raise Preempted(trainer.step, checkpoints.last, agreed.signal_name, agreed.interrupted)
        if saved_at != trainer.step:
            checkpoints.save()
        checkpoints.wait()
        checkpoint.wait_for_deletions()  # a finished run leaves no pruned checkpoint half deleted
    finally:
        trainer.close()
        watchdog.close()
        signals.close()
        if writer is not None:
            writer.close()
    return history


def _evaluation_due(trainer: Trainer, at_stage_end: bool) -> bool:
    """eval.every steps, and (eval.at_stage_end) after a stage's and the run's last step."""
    evaluation = trainer.cfg.eval
    if not trainer.evaluates:
        return False
    every = bool(evaluation.every) and trainer.step % evaluation.every == 0
    return every or (evaluation.at_stage_end and (at_stage_end or trainer.step == trainer.cfg.train.steps))


def _same_run(run_dir: Path, config_text: str, resume: str) -> bool:
    """Is the run directory's metrics.jsonl, with no checkpoint beside it, this very run's? A requeue or a torchrun
    restart after a failure before the first checkpoint (train.resume=auto, and the config.yaml the first attempt
    wrote is this config's text): that run starts over. Any other run is refused its directory."""
    written = run_dir / "config.yaml"
    return resume == "auto" and written.exists() and written.read_text() == config_text


def _keep_aside(path: Path) -> Path:
    """Rename path to the first free <stem>.attempt<N><suffix> beside it (nothing saved is lost); -> the new path."""
    attempt = 1
    while (kept := path.with_name(f"{path.stem}.attempt{attempt}{path.suffix}")).exists():
        attempt += 1
    path.rename(kept)
    return kept
