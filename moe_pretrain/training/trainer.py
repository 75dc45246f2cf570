"""Pretraining on one process or many: the step, its loss accounting, balancing updates and metrics.

One optimizer step = data.micro_batches forward/backward passes over the global batch. Each
data-parallel rank takes its slice of every global micro-batch; every loss is divided by the step's
global count of loss tokens, so summing gradients over ranks and micro-batches gives exactly the
gradient of the token-mean loss of the whole global batch, whatever the layout. Then the sharded
optimizer reduces, clips, steps and gathers, and the routers move their biases on global statistics.
What the trainer advances, and what checkpoints hold, is a TrainingState (state.py); the run's checkpoints are
run_checkpoints.py; the loop around the steps is operations/run_loop.py.
"""

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from gpu_kernels.choice import Kernels
from gpu_kernels.fast_paths import resolve as resolve_kernels
from moe_pretrain.config import Config, ConfigError
from moe_pretrain.config.stage import Stage
from moe_pretrain.data import IGNORE_INDEX, Batch, PretrainingData
from moe_pretrain.data.prefetch import BatchPrefetcher, BatchRequest
from moe_pretrain.data.validation import ValidationData
from moe_pretrain.dtypes import DTYPES
from moe_pretrain.model.counts import attended_keys
from moe_pretrain.model.saved_inputs import SavedInputs
from moe_pretrain.training.evaluation import evaluate, evaluate_long_context
from moe_pretrain.training.mfu import StepMFU
from moe_pretrain.training.moe_stats import combine_moe_stats
from moe_pretrain.training.optim import learning_rate
from moe_pretrain.training.peak_flops import peak_flops
from moe_pretrain.training.run_checkpoints import RunCheckpoints
from moe_pretrain.training.schedule import stage_at, stage_learning_rate
from moe_pretrain.training.stage_switch import StageSwitch
from moe_pretrain.training.state import TrainingState
from moe_pretrain.training.step_hooks import StepContext, StepHook, in_order, step_hooks
from moe_pretrain.training.step_runner import AheadTargets, StepRunner
from moe_pretrain.training.step_telemetry import StepTelemetry
from parallel.collectives import all_reduce_sum
from parallel.optimizer import ShardedOptimizer
from parallel.state import ParallelContext, resolve_layout

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
    attended_keys: float = 0.0
    """The keys an attention query of this rank's batches saw (model/counts.attended_keys): the step's MFU
    counts MLA's attention over the documents it ran, not over whole rows."""


def check_vocabulary(cfg: Config, data: PretrainingData) -> None:
    vocab = data.vocabulary
    if cfg.model.vocab_size < vocab.size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {vocab.size} ids of the "
                          f"data ({vocab.kind} tokenizer + {vocab.size - vocab.base_size} special tokens)")


@dataclass(frozen=True)
class StepPlan:
    """What the next optimizer step does: its stage and its learning rate (Trainer.step_plan)."""

    stage: Stage
    lr: float


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
        """The checked layout with the run's stages, resolved (config/stage.py)."""
        self.dtype = DTYPES[cfg.train.dtype]
        if kernels is None:  # a forced kernel this machine lacks: fail now
            kernels = resolve_kernels(cfg, self.ctx.device, self.dtype)
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
        self.host = kernels.host
        """How the step reads device values on the host (ops/host_values.py: a dry run's are assumed)."""
        self.runner = StepRunner(cfg, self.ctx, self.state.model, self.data, self.host)
        self.pipeline = self.runner.pipeline
        self.stage_switch = StageSwitch(self.state.model, self.ctx, cfg.train.recompute_exchanges)
        self.checkpoints = RunCheckpoints(cfg, self.ctx, self.state, self.batches)
        self._planned: tuple[tuple[int, int], StepPlan] | None = None
        """The last plan made, with the (step, tokens_seen) it is for: a step's plan is made once (step_plan)."""
        self.telemetry = StepTelemetry(self.ctx, self.model, on=bool(cfg.logging.straggler.every)
                                       and self.ctx.distributed)
        """This rank's window of step figures (training/step_telemetry.py), on for the straggler check (a step
        hook the run loop adds: operations/stragglers.py)."""
        self.checkpoints.hooks = step_hooks(cfg, StepContext(self.model, self.optimizer, self.ctx),
                                            self.checkpoints.async_saver)
        self.skipped_total = self.skipped_in_a_row = 0
        self.mfu = StepMFU(cfg.model, peak_flops(cfg.logging.peak_tflops, self.device, self.dtype)
                           * self.ctx.layout.world_size)
        """A step's model FLOPs utilisation: mfu(tokens, seconds, seq_len)."""

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model: the whole model, or its pipeline chunks under their global names."""
        return self.state.model

    @property
    def hooks(self) -> list[StepHook]:
        """What each step runs around its update besides it, in HOOK_ORDER (training/step_hooks.py); the run's
        checkpoints hold the list, as they keep the hooks' states."""
        return self.checkpoints.hooks

    @property
    def evaluates(self) -> bool:
        """Whether the run has held-out data to evaluate on (eval.tokens > 0)."""
        return self.validation is not None

    def evaluate(self, stage: Stage, long_context: bool = False) -> dict[str, float]:
        """The held-out loss at the stage's length and split, and with long_context the loss by position and the
        retrieval probe (training/evaluation.py; collective: every rank calls it)."""
        record = evaluate(self.runner, self.validation, stage)
        if long_context:
            record.update(evaluate_long_context(self.runner, self.validation, stage))
        return record

    def close(self) -> None:
        """At the end of a run: the parameters gathered for whoever reads them next, no batch prepared ahead."""
        self.optimizer.finish_parameter_gathers()
        self.batches.close()

    def add_hook(self, hook: StepHook) -> None:
        """Run `hook` with the step's own, in its place in HOOK_ORDER (in place of one of its name); the run's
        checkpoints keep its state."""
        self.checkpoints.hooks = in_order([*(h for h in self.hooks if h.name != hook.name), hook])

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
        """The plan of the step after `step` steps and `tokens_seen` tokens (default: the next one). Made once a
        step: the step's plan is the one made while its batches were prepared ahead."""
        key = (self.step if step is None else step, self.tokens_seen if tokens_seen is None else tokens_seen)
        if self._planned is None or self._planned[0] != key:
            self._planned = key, self._plan(*key)
        return self._planned[1]

    def _plan(self, step: int, tokens_seen: int) -> StepPlan:
        cfg = self.cfg
        if not cfg.stages:
            return StepPlan(self.layout.stages[0], learning_rate(step, cfg.train.steps, cfg.optim))
        point = stage_at(cfg.stages, tokens_seen)
        return StepPlan(self.layout.stages[point.index], stage_learning_rate(point))

    def _batch_request(self, stage: Stage) -> BatchRequest:
        """This rank's rows of the stage's batches; only ranks that embed images read their pixels."""
        data_parallel = self.ctx.context(stage.cp)
        with_patches = self.pipeline is None or self.pipeline.holds_first
        return BatchRequest(stage, data_parallel.dp_rank, data_parallel.dp_size, with_patches)

    def _next_micro_batches(self, stage: Stage) -> tuple[list[Batch], float]:
        """This step's batches and the keys a query of theirs attends to (counted on the host, before they
        move to the device), then the next step's started in the background (unless this is the last)."""
        with self.host.data_values():  # real batches in a dry run as well
            batches = self.batches.take(self._batch_request(stage))
            keys = attended_keys(torch.cat([batch.doc_ids for batch in batches]))
            if self.step + 1 < (self.cfg.train.exit_at_step or self.cfg.train.steps):
                ahead = self.step_plan(self.step + 1, self.tokens_seen + stage.batch_tokens)
                self.batches.prepare_ahead(self._batch_request(ahead.stage))
            return [batch.to(self.device) for batch in batches], keys

    def train_step(self) -> StepResult:
        """One optimizer step, its collectives' waits metered for the straggler check."""
        with self.telemetry.metering():
            result = self._train_step()
        saver = self.checkpoints.async_saver
        self.telemetry.add_step(result.seconds, result.data_wait_s, saver.staging_wait_s if saver else 0.0)
        return result

    def _train_step(self) -> StepResult:
        cfg, ctx = self.cfg, self.ctx
        start = time.perf_counter()
        self.model.train()
        plan = self.step_plan()
        stage = plan.stage
        self.stage_switch.apply(stage)
        batches, keys = self._next_micro_batches(stage)
        # Scalars stay on the device until the step's one host read below. Under context parallelism each
        # rank counts (and later scores) only its own positions.
        local = ctx.context(stage.cp).local
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
        with self.telemetry.part("forward_backward"):
            sums = self.runner.forward_backward(stage, batches, loss_tokens, ahead)
        if self.pipeline is None:
            sums = all_reduce_sum(sums, ctx.dp_group)
            loss = sums[0] / loss_tokens
        else:  # each rank's share of the mean (non-zero on the last stage's first tensor rank)
            sums = all_reduce_sum(sums, dist.group.WORLD)
            loss = sums[0]
        mtp = sums[1:] / ahead.tokens if ahead is not None else sums[1:]
        with self.telemetry.part("optimizer"):
            norm = self.optimizer.reduce_gradients()
        scalars = torch.cat([torch.stack([loss, norm.to(loss.dtype)]), mtp])
        loss_value, grad_norm, *mtp_losses = self.host.scalar_list(scalars)
        skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        for hook in self.hooks:
            hook.before_update()
        if not skipped:
            with self.telemetry.part("optimizer"):
                self.optimizer.update(cfg.optim.grad_clip, grad_norm)
        for hook in self.hooks:
            hook.after_update(skipped)
        if skipped:
            self._count_skip(loss_value, grad_norm)
        else:
            self.skipped_in_a_row = 0
        self.step += 1
        self.tokens_seen += stage.batch_tokens
        return StepResult(loss_value, grad_norm, lr, stage.batch_tokens, time.perf_counter() - start, stage.seq_len,
                          stage.name, skipped, stage.cp, self.batches.wait_s, tuple(mtp_losses), keys)

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
                f"{self.checkpoints.last or 'none'}")

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
            "mfu": self.mfu(result.tokens, result.seconds, result.seq_len, result.attended_keys),
            "skipped": result.skipped,
            "skipped_total": self.skipped_total,
            "step_time_s": result.seconds,
            "data_wait_s": result.data_wait_s,
            "moe": self._moe_stats(),
            **({"mtp_loss": list(result.mtp_losses)} if result.mtp_losses else {}),
            **{key: value for hook in self.hooks for key, value in hook.metrics(self.step).items()},
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
