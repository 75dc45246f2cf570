"""Single-process pretraining: the step, its loss accounting, balancing updates and metrics.

One optimizer step = data.micro_batches forward/backward passes whose losses are normalised by the
step's total count of loss tokens (so the step's gradient is that of the token-mean loss over the
whole global batch), then clipping, AdamW, the LR schedule, and the routers' bias updates.
"""

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from moe_pretrain.config import Config, ConfigError, config_to_dict
from moe_pretrain.data import IGNORE_INDEX, PretrainingData
from moe_pretrain.data.tokenizer import VOCAB_SIZE
from moe_pretrain.model import MoETransformer
from moe_pretrain.ops.norms import compute_dtype
from moe_pretrain.training.metrics import MetricsWriter, ProgressBar
from moe_pretrain.training.optim import build_optimizer, learning_rate

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float


def check_supported(cfg: Config) -> None:
    """Refuse settings whose machinery has not landed yet, rather than silently ignoring them."""
    for key in ("tp", "pp", "ep", "cp", "vpp"):
        if getattr(cfg.parallel, key) != 1:
            raise ConfigError(f"parallel.{key}={getattr(cfg.parallel, key)}: this build trains the "
                              "single-process layout only; set every parallel.* to 1")
    if cfg.checkpoint.interval:
        raise ConfigError(f"checkpoint.interval={cfg.checkpoint.interval}: checkpoint saving is not "
                          "implemented yet; set checkpoint.interval=0")
    if cfg.model.vocab_size < VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's "
                          f"{VOCAB_SIZE} ids")


class Trainer:
    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        check_supported(cfg)
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.train.dtype]
        torch.manual_seed(cfg.train.seed)
        model = MoETransformer(cfg.model)
        # bf16 keeps fp32 master weights and runs the matmuls under autocast (Megatron's recipe);
        # fp32 and fp64 run the whole model in that dtype.
        param_dtype = torch.float32 if self.dtype == torch.bfloat16 else self.dtype
        self.model = model.to(device=self.device, dtype=param_dtype)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.data = PretrainingData(cfg.data, cfg.model.vision)
        self.step = 0
        self.tokens_seen = 0

    def autocast(self):
        if self.dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> StepResult:
        cfg = self.cfg
        start = time.perf_counter()
        self.model.train()
        rows = cfg.data.batch_size // cfg.data.micro_batches
        batches = [self.data.next_batch(rows).to(self.device) for _ in range(cfg.data.micro_batches)]
        loss_tokens = sum(b.loss_tokens for b in batches)
        lr = learning_rate(self.step, cfg.train.steps, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for batch in batches:
            with self.autocast():
                logits, balance_loss = self.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask)
            ce_sum = F.cross_entropy(logits.to(compute_dtype(logits.dtype)).flatten(0, 1), batch.labels.flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
            loss = ce_sum / max(loss_tokens, 1) + balance_loss / cfg.data.micro_batches
            loss.backward()
            total_loss += float(ce_sum.detach())
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.model.update_balancing()
        self.step += 1
        step_tokens = sum(b.tokens.numel() for b in batches)
        self.tokens_seen += step_tokens
        return StepResult(total_loss / max(loss_tokens, 1), grad_norm, lr, step_tokens,
                          time.perf_counter() - start)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def metrics(self, result: StepResult) -> dict:
        return {
            "step": self.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": self.tokens_seen,
            "seq_len": self.cfg.data.seq_len,
            "tokens_per_s": result.tokens / result.seconds,
            "step_time_s": result.seconds,
            "moe": {str(i): r.pop_stats() for i, r in self.model.routers().items()},
        }

    def run(self) -> list[dict]:
        """Train train.steps steps, writing run_dir/config.yaml and run_dir/metrics.jsonl."""
        cfg = self.cfg
        run_dir = Path(cfg.train.run_dir)
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"train.run_dir={run_dir} already holds metrics.jsonl from an earlier run; "
                              "choose another train.run_dir (nothing was overwritten)")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        bar = ProgressBar(cfg.train.steps, cfg.logging.log_every, cfg.logging.progress)
        history = []
        try:
            while self.step < cfg.train.steps:
                result = self.train_step()
                record = self.metrics(result)
                writer.write(record)
                history.append(record)
                bar.update(self.step - 1, result.loss, record["tokens_per_s"], result.lr)
        finally:
            writer.close()
        return history
