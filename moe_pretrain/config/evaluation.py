"""The `eval` section: held-out loss during training."""

from dataclasses import dataclass, field

from moe_pretrain.config.blend import BlendConfig
from moe_pretrain.config.errors import require


@dataclass
class EvalConfig:
    """Validation loss on held-out data, per dataset and overall, at the sequence length in force."""

    tokens: int = 0
    """Held-out tokens per dataset per evaluation (whole rows of seq_len + 1); 0 = no evaluation."""
    every: int = 0
    """Steps between evaluations; 0 = only at the end of each stage and of the run."""
    at_stage_end: bool = True
    """Also evaluate after the last step of every stage (and of the run)."""
    blend: list[BlendConfig] = field(default_factory=list)
    """Validation datasets; empty = documents held out of every training dataset (holdout)."""
    holdout: float = 0.01
    """With eval.blend empty: the share of each training dataset's documents held out of training, chosen by
    a seeded rule on the dataset's name and the record number (the same on every run and layout)."""

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def __post_init__(self) -> None:
        require(self.tokens >= 0, f"eval.tokens={self.tokens} must be >= 0 (0 = no evaluation)")
        require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        require(0.0 < self.holdout < 1.0, f"eval.holdout={self.holdout} must be in (0, 1)")
        for i, entry in enumerate(self.blend):
            entry.check(f"eval.blend[{i}]")
