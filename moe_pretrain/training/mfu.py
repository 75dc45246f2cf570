"""Model FLOPs utilisation of a step: the model's training FLOPs per token (model/counts.py, per sequence
length: attention's share grows with it) times the step's tokens, over the step's time at the peak of all
processes (training/peak_flops.py)."""

from moe_pretrain.config import ModelConfig
from moe_pretrain.model.counts import count


class StepMFU:
    def __init__(self, model: ModelConfig, peak_flops: float):
        self.model, self.peak_flops = model, peak_flops
        self._flops_per_token: dict[int, float] = {}

    def __call__(self, tokens: int, seconds: float, seq_len: int) -> float:
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = count(self.model, seq_len)["flops_per_token"]
        return self._flops_per_token[seq_len] * tokens / (seconds * self.peak_flops)
