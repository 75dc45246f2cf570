"""Pretraining on one process or many: the step, its loss accounting, balancing updates and metrics.

One optimizer step = data.micro_batches forward/backward passes over the global batch. Each
data-parallel rank takes its slice of every global micro-batch; every loss is divided by the step's
global count of loss tokens, so summing gradients over ranks and micro-batches gives exactly the
gradient of the token-mean loss of the whole global batch, whatever the layout. Then the sharded
optimizer reduces, clips, steps and gathers, and the routers move their biases on global statistics.
The trainer is the loop; what it advances, and what checkpoints hold, is a TrainingState (state.py).
"""

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from gpu_kernels.choice import Kernels
from gpu_kernels.fast_paths import resolve as resolve_kernels
from moe_pretrain import checkpoint
from moe_pretrain.config import Config, ConfigError, config_to_dict
from moe_pretrain.config.stage_settings import stage_settings
from moe_pretrain.data import IGNORE_INDEX, Batch, PretrainingData
from moe_pretrain.data.prefetch import BatchPrefetcher, BatchRequest
from moe_pretrain.data.validation import ValidationData
from moe_pretrain.model.saved_inputs import SavedInputs
from moe_pretrain.ops.host_values import data_values, scalar_list
from moe_pretrain.training.evaluation import evaluate, evaluate_long_context
from moe_pretrain.training.metrics import MetricsWriter, ProgressBar
from moe_pretrain.training.mfu import StepMFU
from moe_pretrain.training.moe_stats import combine_moe_stats
from moe_pretrain.training.optim import learning_rate
from moe_pretrain.training.outcome import Preempted
from moe_pretrain.training.peak_flops import peak_flops
from moe_pretrain.training.preemption import StopSignals, stop_at_from_env
from moe_pretrain.training.schedule import stage_at, stage_learning_rate
from moe_pretrain.training.stage_switch import StageModules, StageSwitch
from moe_pretrain.training.state import TrainingState
from moe_pretrain.training.step_hooks import step_hooks
from moe_pretrain.training.step_runner import AheadTargets, StepPlan, StepRunner
from moe_pretrain.training.wandb_run import check_wandb, open_wandb_run
from moe_pretrain.training.watchdog import StepWatchdog
from parallel.collectives import all_reduce_max, all_reduce_sum, barrier
from parallel.context_parallel import mla_exchange
from parallel.optimizer import ShardedOptimizer
from parallel.parallelize import DTYPES
from parallel.state import ParallelContext, new_host_group, resolve_layout

log = logging.getLogger(__name__)

@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    seq_len: int
    stage: str
    skipped: bool
    cp: int = 1
    data_wait_s: float = 0.0
    """Seconds the step waited for its batches (near zero when they were prepared in the background)."""
    mtp_losses: tuple[float, ...] = ()
    """Each multi-token-prediction block's mean cross-entropy (model.mtp.layers)."""


def check_vocabulary(cfg: Config, data: PretrainingData) -> None:
    vocab = data.vocabulary
    if cfg.model.vocab_size < vocab.size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {vocab.size} ids of the "
                          f"data ({vocab.kind} tokenizer + {vocab.size - vocab.base_size} special tokens)")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext | None = None, *,
                 fake: FakeTensorMode | None = None, kernels: Kernels | None = None):
        """fake: a dry run's fake-tensor mode (launch/dryrun.py); the rank's state (model, optimizer) is built
        in it, its initial values not drawn. kernels: what the model is built with (None: resolved for this
        machine's device; a dry run passes those of the GPU it plays)."""
        self.ctx = ctx or ParallelContext.single()
        self.layout = resolve_layout(cfg, self.ctx.layout.world_size)
        """The checked layout with every step shape's micro-batch count (derived where the config leaves 0)."""
        self.dtype = DTYPES[cfg.train.dtype]
        if kernels is None:  # a forced kernel this machine lacks: fail now
            kernels = resolve_kernels(cfg, self.ctx.device, self.dtype)
        check_wandb(cfg)
        self.cfg = cfg
        self.data = PretrainingData(cfg)
        check_vocabulary(cfg, self.data)
        self.batches = BatchPrefetcher(self.data, background=cfg.data.prefetch)
        self.validation = ValidationData(self.data) if cfg.eval.enabled else None
        self.device = self.ctx.device
        torch.manual_seed(cfg.train.seed)  # whatever draws from torch's RNG in training (initial values do not)
        with fake or contextlib.nullcontext():
            self.state = TrainingState(cfg, self.ctx, kernels=kernels, draw_values=fake is None)
        self.state.token_ids = self.data.vocabulary.special_ids()
        self.runner = StepRunner(cfg, self.ctx, self.state.model, self.data)
        self.pipeline = self.runner.pipeline
        self.stage_switch = StageSwitch(self.state.model, self.ctx, cfg.train.recompute_exchanges)
        self.checkpoint_root = Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")
        writes = None
        if self.ctx.distributed:
            # Checkpoint I/O gets its own gloo groups (created collectively, here, on every rank): its collectives
            # never interleave with training's, and their timeout grows with the largest rank's state. Background
            # writes take a second one, apart from the training thread's polls and commits (AsyncSaver).
            timeout = self._checkpoint_timeout()
            self.state.checkpoint_group = new_host_group(timeout)
            writes = new_host_group(timeout) if cfg.checkpoint.async_save else None
        self.async_saver = checkpoint.AsyncSaver(self.state.checkpoint_group, writes) if cfg.checkpoint.async_save \
            else None
        self.stage_settings = stage_settings(cfg)
        """Each stage's cp, cp_mla, recompute and saved_inputs with the run's defaults (config/stage_settings.py)."""
        self.hooks = step_hooks(self)
        """What each step runs around its update besides it (training/step_hooks.py)."""
        self.skipped_total = self.skipped_in_a_row = 0
        self.last_checkpoint: Path | None = None
        self.mfu = StepMFU(cfg.model, peak_flops(cfg.logging.peak_tflops, self.device, self.dtype)
                           * self.ctx.layout.world_size)
        """A step's model FLOPs utilisation: mfu(tokens, seconds, seq_len)."""

    def _checkpoint_timeout(self) -> timedelta:
        largest = all_reduce_max(torch.tensor([self.state.state_bytes()], dtype=torch.float64, device=self.device),
                                 dist.group.WORLD)
        limit = checkpoint.checkpoint_timeout(self.cfg.parallel.timeout_s, int(largest.item()),
                                              self.cfg.checkpoint.io_floor_mb_s * 1e6)
        log.debug(f"checkpoint collectives time out after {limit.total_seconds():.0f} s")
        return limit

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model: the whole model, or its pipeline chunks under their global names."""
        return self.state.model

    @property
    def saved_inputs(self) -> SavedInputs | None:
        """The store of the layers' saved inputs under full recomputation (its ledger: model/saved_inputs.py)."""
        return self.stage_switch.saved_inputs

    @property
    def optimizer(self) -> ShardedOptimizer:
        return self.state.optimizer

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def tokens_seen(self) -> int:
        return self.state.tokens_seen

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self.state.tokens_seen = value

    def step_plan(self, step: int | None = None, tokens_seen: int | None = None) -> StepPlan:
        """The plan of the step after `step` steps and `tokens_seen` tokens (default: the next one)."""
        cfg = self.cfg
        step = self.step if step is None else step
        tokens_seen = self.tokens_seen if tokens_seen is None else tokens_seen
        if not cfg.stages:
            s = self.stage_settings[0]
            return StepPlan(cfg.data.seq_len, cfg.data.batch_size, self.layout.micro_batches[0],
                            learning_rate(step, cfg.train.steps, cfg.optim), "main", None, cp=s.cp,
                            recompute=s.recompute, cp_mla=self._mla_exchange(s.cp_mla, s.cp),
                            saved_inputs=s.saved_inputs)
        point = stage_at(cfg.stages, tokens_seen)
        stage, s = point.stage, self.stage_settings[point.index]
        return StepPlan(stage.seq_len, stage.rows, self.layout.micro_batches[point.index],
                        stage_learning_rate(point), stage.name, point.end_tokens, point.index, stage.rope_theta,
                        s.cp, s.recompute, self._mla_exchange(s.cp_mla, s.cp), s.saved_inputs)

    def _mla_exchange(self, method: str, cp: int) -> str:
        return mla_exchange(method, cp, self.cfg.model.mla.num_heads // self.cfg.parallel.tp)

    def _batch_request(self, plan: StepPlan) -> BatchRequest:
        """This rank's rows of the plan's batches; only ranks that embed images read their pixels."""
        data_parallel = self.ctx.context(plan.cp)
        with_patches = self.pipeline is None or self.pipeline.holds_first
        return BatchRequest(plan.stage_index, plan.rows // plan.micro_batches, plan.micro_batches,
                            data_parallel.dp_rank, data_parallel.dp_size, with_patches)

    def _next_micro_batches(self, plan: StepPlan) -> list[Batch]:
        """This step's batches, then the next step's started in the background (unless this is the last)."""
        with data_values():  # real batches in a dry run as well
            batches = self.batches.take(self._batch_request(plan))
            if self.step + 1 < (self.cfg.train.exit_at_step or self.cfg.train.steps):
                step_tokens = plan.rows * plan.seq_len
                self.batches.prepare_ahead(self._batch_request(self.step_plan(self.step + 1,
                                                                              self.tokens_seen + step_tokens)))
            return [batch.to(self.device) for batch in batches]

    def train_step(self) -> StepResult:
        cfg, ctx = self.cfg, self.ctx
        start = time.perf_counter()
        self.model.train()
        plan = self.step_plan()
        self.stage_switch.apply(StageModules(plan.cp, plan.cp_mla, plan.recompute, plan.saved_inputs,
                                             plan.rope_theta or cfg.model.mla.rope_theta))
        batches = self._next_micro_batches(plan)
        # Scalars stay on the device until the step's one host read below. Under context parallelism each
        # rank counts (and later scores) only its own positions.
        local = ctx.context(plan.cp).local
        local_tokens = torch.stack([(local(b.labels) != IGNORE_INDEX).sum() for b in batches])
        loss_tokens = all_reduce_sum(local_tokens.sum(), ctx.dp_group).clamp_min(1)
        ahead = None
        if cfg.model.mtp.layers:  # each block's targets, counted as the next-token loss's are
            labels = [self.runner.ahead_labels(b) for b in batches]
            counts = torch.stack([(local(a[:, k]) != IGNORE_INDEX).sum()
                                  for a in labels for k in range(a.shape[1])]).view(len(labels), -1)
            ahead = AheadTargets(labels, all_reduce_sum(counts.sum(0), ctx.dp_group).clamp_min(1))
        lr = plan.lr
        self.optimizer.set_lr(lr, self.step)
        self.optimizer.zero_grad(backwards=len(batches))  # the reduce-scatters start during the last backward
        for hook in self.hooks:
            hook.before_step()
        sums = self.runner.forward_backward(plan, batches, loss_tokens, ahead)
        if self.pipeline is None:
            sums = all_reduce_sum(sums, ctx.dp_group)
            loss = sums[0] / loss_tokens
        else:  # each rank's share of the mean (non-zero on the last stage's first tensor rank)
            sums = all_reduce_sum(sums, dist.group.WORLD)
            loss = sums[0]
        mtp = sums[1:] / ahead.tokens if ahead is not None else sums[1:]
        norm = self.optimizer.reduce_gradients()
        loss_value, grad_norm, *mtp_losses = scalar_list(torch.cat([torch.stack([loss, norm.to(loss.dtype)]), mtp]))
        skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        for hook in self.hooks:
            hook.before_update()
        if not skipped:
            self.optimizer.update(cfg.optim.grad_clip, grad_norm)
        for hook in self.hooks:
            hook.after_update(skipped)
        if skipped:
            self._count_skip(loss_value, grad_norm)
        else:
            self.skipped_in_a_row = 0
        self.step += 1
        step_tokens = plan.rows * plan.seq_len
        self.tokens_seen += step_tokens
        return StepResult(loss_value, grad_norm, lr, step_tokens, time.perf_counter() - start, plan.seq_len,
                          plan.stage, skipped, plan.cp, self.batches.wait_s, tuple(mtp_losses))

    def _count_skip(self, loss: float, grad_norm: float) -> None:
        self.skipped_total += 1
        self.skipped_in_a_row += 1
        step = self.step + 1
        if self.ctx.is_logging_rank:
            log.warning(f"step {step}: loss {loss}, gradient norm {grad_norm}: not finite, update skipped "
                        f"({self.skipped_in_a_row} in a row)")
        if self.skipped_in_a_row >= self.cfg.train.max_skipped_steps:
            raise NonFiniteError(
                f"{self.skipped_in_a_row} steps in a row up to step {step} had a non-finite loss or gradient "
                f"(train.max_skipped_steps={self.cfg.train.max_skipped_steps}); last good checkpoint: "
                f"{self.last_checkpoint or 'none'}")

    def metrics(self, result: StepResult) -> dict:
        """The step's record; collective (global expert loads), so every rank calls it."""
        return {
            "step": self.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": self.tokens_seen,
            "stage": result.stage,
            "seq_len": result.seq_len,
            "cp": result.cp,
            "tokens_per_s": result.tokens / result.seconds,
            "mfu": self.mfu(result.tokens, result.seconds, result.seq_len),
            "skipped": result.skipped,
            "skipped_total": self.skipped_total,
            "step_time_s": result.seconds,
            "data_wait_s": result.data_wait_s,
            "moe": self._moe_stats(),
            **({"mtp_loss": list(result.mtp_losses)} if result.mtp_losses else {}),
            **{key: value for hook in self.hooks for key, value in hook.metrics().items()},
        }

    def _records_loads(self) -> bool:
        every = self.cfg.logging.expert_load_every
        return bool(every) and (self.step == 1 or self.step % every == 0 or self.step == self.cfg.train.steps)

    def _moe_stats(self) -> dict[str, dict[str, float | list[int]]]:
        """Every MoE layer's health, combined over the pipeline stages (collective over the pp group)."""
        group = self.ctx.pp_group if self.ctx.layout.pp > 1 else None
        m = self.cfg.model  # the multi-token-prediction blocks' layers follow the backbone's
        return combine_moe_stats(self.model.routers(), m.num_layers + m.mtp.layers, m.moe.num_experts,
                                 self._records_loads(), group, self.device)

    def save_checkpoint(self) -> Path | None:
        """Save this step (synchronously, or start a background save); returns the committed directory."""
        self.state.data_position = self.batches.position
        if self.async_saver is None:
            self.last_checkpoint = self.state.save(self.checkpoint_root)
            return self.last_checkpoint
        c = self.cfg.checkpoint
        # The previous save, if still in flight, is committed (or its failure reported) on its own first: a
        # failure found there must not also cost this step's save (on_async_failure=continue).
        self.last_checkpoint = self._guard_async(self.async_saver.wait) or self.last_checkpoint
        # Snapshots only: an async save writes this JSON at commit time, steps later.
        self._guard_async(self.async_saver.start, self.checkpoint_root, self.step, *self.state.snapshot(),
                          c.keep_last, c.keep_every)
        return None

    def _guard_async(self, operation, *args):
        """Run an async-save operation; a failed background save stops the run or, by config, is reported."""
        try:
            return operation(*args)
        except checkpoint.CheckpointError as err:
            if self.cfg.checkpoint.on_async_failure == "stop":
                raise
            if self.ctx.is_logging_rank:
                log.error(f"checkpoint: background save failed, training continues: {err}")
            return None

    def resume(self) -> Path | None:
        """Load the checkpoint train.resume asks for (every rank verifies its share of the files while the
        load reads them; all agree)."""
        verifier = checkpoint.verifying_load(self.state.load, self.state.checkpoint_group)
        path, _ = checkpoint.find(self.checkpoint_root, self.cfg.train.resume, verifier,  # find() logs what it skips
                                  check_fit=self.state.check_fit, set_aside=True)
        if path is None:
            return None
        if self.state.data_position:  # a model-only checkpoint (imported weights) starts the data afresh
            self.batches.load_state(self.state.data_position)
        self.state.restore_rng()
        log.info(f"checkpoint: resumed from {path} at step {self.step}")
        self.last_checkpoint = Path(path)
        return Path(path)

    def run(self) -> list[dict]:
        """Train to train.steps (or train.exit_at_step), resuming per train.resume and saving checkpoints;
        rank 0 writes run_dir/config.yaml and run_dir/metrics.jsonl. Returns the steps' records: empty
        when the resumed checkpoint is already at the end (a relaunch of a finished run)."""
        cfg, ctx = self.cfg, self.ctx
        run_dir = Path(cfg.train.run_dir)
        resumed = self.resume() is not None
        config_text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        restarted = not resumed and (run_dir / "metrics.jsonl").exists()
        if restarted and not _same_run(run_dir, config_text, cfg.train.resume):
            raise ConfigError(f"train.run_dir={run_dir} already holds metrics.jsonl from an earlier run and no "
                              "checkpoint to resume; choose another train.run_dir (nothing was overwritten)")
        stop = cfg.train.exit_at_step or cfg.train.steps
        if self.step >= stop:
            end = "train.steps" if stop == cfg.train.steps else "train.exit_at_step"
            log.info(f"run already finished at step {self.step} ({end}={stop}); nothing to do")
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
        saved_at = self.step if resumed else -1
        signals = StopSignals(stop_at_from_env())
        save_interval_s = cfg.checkpoint.every_minutes * 60
        last_save_time = time.monotonic()
        t = cfg.train
        watchdog = StepWatchdog(run_dir, ctx.rank, t.hang_multiple, t.hang_min_s, t.hang_timeout_s)
        stage = None
        try:
            while self.step < stop:
                plan = self.step_plan()
                if plan.stage != stage:
                    stage = plan.stage
                    watchdog.new_stage()
                watchdog.begin(self.step + 1)
                result = self.train_step()
                watchdog.end()
                record = self.metrics(result)
                at_boundary = plan.stage_end_tokens is not None and self.tokens_seen == plan.stage_end_tokens
                if self._evaluation_due(at_boundary):
                    record.update(evaluate(self.runner, self.validation, plan))
                    if self.cfg.eval.long_context and (at_boundary or self.step == cfg.train.steps):
                        record.update(evaluate_long_context(self.runner, self.validation, plan))
                if writer is not None:
                    writer.write(record)
                history.append(record)
                bar.update(self.step - 1, result.loss, record["tokens_per_s"], result.lr, record.get("eval_loss"))
                if self.async_saver is not None:
                    self.last_checkpoint = self._guard_async(self.async_saver.poll) or self.last_checkpoint
                time_due = bool(save_interval_s) and time.monotonic() - last_save_time >= save_interval_s
                agreed = signals.agreed(ctx.distributed, self.device, save_due=time_due,
                                        next_step_s=result.seconds)
                at_interval = bool(cfg.checkpoint.every) and self.step % cfg.checkpoint.every == 0
                if at_boundary or at_interval or agreed.save_due:
                    self.save_checkpoint()
                    saved_at, last_save_time = self.step, time.monotonic()
                if agreed.signal_name and self.step < stop:
                    if saved_at != self.step:
                        self.save_checkpoint()
                    self._wait_for_async_save()
                    raise Preempted(self.step, self.last_checkpoint, agreed.signal_name, agreed.interrupted)
            if saved_at != self.step:
                self.save_checkpoint()
            self._wait_for_async_save()
            checkpoint.wait_for_deletions()  # a finished run leaves no pruned checkpoint half deleted
        finally:
            self.optimizer.finish_parameter_gathers()  # the caller may read the parameters
            self.batches.close()
            watchdog.close()
            signals.close()
            if writer is not None:
                writer.close()
        return history

    def _evaluation_due(self, at_stage_end: bool) -> bool:
        """eval.every steps, and (eval.at_stage_end) after a stage's and the run's last step."""
        evaluation = self.cfg.eval
        if self.validation is None:
            return False
        every = bool(evaluation.every) and self.step % evaluation.every == 0
        return every or (evaluation.at_stage_end and (at_stage_end or self.step == self.cfg.train.steps))

    def _wait_for_async_save(self) -> None:
        if self.async_saver is not None:
            self.last_checkpoint = self._guard_async(self.async_saver.wait) or self.last_checkpoint


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
