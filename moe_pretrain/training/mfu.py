"""Model FLOPs utilisation of a step: the model's training FLOPs per token (model/counts.py, per sequence
length and the keys an attention query saw: attention stays inside a document, so its share follows the
documents the step ran, not the row's length) times the step's tokens, over the step's time at the peak of all
processes (training/peak_flops.py)."""

from moe_pretrain.config import ModelConfig
from moe_pretrain.model.counts import count


class StepMFU:
    def __init__(self, model: ModelConfig, peak_flops: float):
        self.model, self.peak_flops = model, peak_flops

    def __call__(self, tokens: int, seconds: float, seq_len: int, keys: float | None = None) -> float:
        """keys: the keys a query of the step's documents attends to (None: one document per row, the bound)."""
        return count(self.model, seq_len, keys)["flops_per_token"] * tokens / (seconds * self.peak_flops)
