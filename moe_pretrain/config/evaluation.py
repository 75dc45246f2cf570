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
    long_context: bool = True
    """At the end of each stage (and of the run): the loss by position bucket on the longest held-out
    documents, and the pass-key retrieval probe, at the stage's sequence length."""
    long_documents: int = 8
    """How many of the longest held-out documents the loss by position reads (each from its first token)."""
    position_base: int = 1024
    """Position buckets: [0, b), [b, 4b), [4b, 16b), ... up to the sequence length (b shrinks to seq_len / 16
    for short stages)."""
    probe_samples: int = 8
    """Pass-key samples per (length, depth) cell of the retrieval probe; 0 = no probe."""

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def __post_init__(self) -> None:
        require(self.tokens >= 0, f"eval.tokens={self.tokens} must be >= 0 (0 = no evaluation)")
        require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        require(0.0 < self.holdout < 1.0, f"eval.holdout={self.holdout} must be in (0, 1)")
        require(self.long_documents >= 1 and self.position_base >= 1 and self.probe_samples >= 0,
                f"eval.long_documents={self.long_documents} and eval.position_base={self.position_base} must be "
                f">= 1, eval.probe_samples={self.probe_samples} >= 0")
        for i, entry in enumerate(self.blend):
            entry.check(f"eval.blend[{i}]")
