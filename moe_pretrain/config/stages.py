"""The staged context-extension schedule (docs/model.md, "Training schedule"): one config for the whole run.

Each stage trains `tokens` tokens at `seq_len`, with a global batch of `batch_tokens` tokens split into
`micro_batches`, under its own learning-rate segment. The stage in force is a pure function of the
tokens consumed, so transitions happen at exact token counts and survive resume on any layout.
"""

from dataclasses import dataclass, field
from typing import Literal

from moe_pretrain.config.blend import BlendConfig, check_long_documents
from moe_pretrain.config.errors import require, require_positive
from moe_pretrain.config.recompute import recompute_problem


@dataclass
class StageConfig:
    name: str = "stage"
    """The stage's name in logs, metrics and launch.plan (8k, 64k, ...)."""
    tokens: int = 0
    """Tokens trained in this stage; a whole number of global batches."""
    seq_len: int = 8192
    """Tokens per sequence in this stage."""
    batch_tokens: int = 4096 * 8192
    """Global batch per optimizer step, in tokens (a multiple of seq_len)."""
    micro_batches: int = 0
    """0 = derived from the layout at start, as data.micro_batches."""
    cp: int = 0
    """Context-parallel size in this stage (0 = parallel.cp): long stages split their sequences, short
    ones need not pay for it. tp, pp and ep stay those of the run; data parallel takes what cp leaves."""
    cp_mla: Literal["", "auto", "latent", "ulysses"] = ""
    """MLA's exchange under context parallelism in this stage ("" = parallel.cp_mla)."""
    recompute: str = ""
    """Activation recomputation in this stage, as train.recompute says ("" = train.recompute)."""
    saved_inputs: Literal["", "device", "host", "fp8"] = ""
    """Where full recomputation keeps the layers' inputs in this stage ("" = train.saved_inputs)."""
    lr_peak: float = 3e-4
    """The stage's peak learning rate (after its warmup)."""
    lr_end: float = 3e-5
    """The learning rate its decay ends at."""
    warmup_tokens: int = 0
    """Linear warmup from 0 to lr_peak over the first tokens of the stage (usually only the first stage)."""
    decay: Literal["cosine", "linear", "constant", "run_cosine"] = "cosine"
    """From lr_peak to lr_end over the rest of the stage (constant: stay at lr_peak; WSD = constant stages
    followed by a decaying one). run_cosine: consecutive run_cosine stages share ONE cosine from lr_peak to lr_end
    over all their tokens, after the first one's warmup_tokens (the stage boundaries cut the schedule, they do not
    restart it: the model class's report trains one cosine with 1% warmup across its 8K -> 1M stages); every
    stage of the span states the same lr_peak and lr_end, and only the first a warmup."""
    rope_theta: float = 0.0
    """RoPE base for this stage when model.mla.position=rope (full size is NoPE: no effect there);
    0 keeps model.mla.rope_theta."""
    blend: list[BlendConfig] = field(default_factory=list)
    """This stage's datasets and token shares (data.blend entries: path, weight); empty = data.blend."""
    long_doc_share: float | None = None
    """Share of this stage's tokens from long documents; None = data.long_doc_share."""
    long_doc_tokens: int = 0
    """Documents of at least this many tokens count as long in this stage; 0 = data.long_doc_tokens."""

    def check(self, where: str) -> None:
        problem = recompute_problem(self.recompute) if self.recompute else None
        require(problem is None, f"{where}.recompute={problem}")
        require_positive(where, tokens=self.tokens, seq_len=self.seq_len, batch_tokens=self.batch_tokens,
                         lr_peak=self.lr_peak)
        require(self.micro_batches >= 0, f"{where}.micro_batches={self.micro_batches} must be >= 0 (0 = derived)")
        require(self.cp >= 0, f"{where}.cp={self.cp} must be >= 0 (0 = parallel.cp)")
        require(self.batch_tokens % self.seq_len == 0,
                f"{where}.batch_tokens={self.batch_tokens} is not a multiple of {where}.seq_len={self.seq_len}")
        rows = self.batch_tokens // self.seq_len
        require(not self.micro_batches or rows % self.micro_batches == 0,
                f"{where}: {rows} sequences per step are not divisible by {where}.micro_batches={self.micro_batches}")
        require(self.tokens % self.batch_tokens == 0,
                f"{where}.tokens={self.tokens} is not a whole number of {where}.batch_tokens={self.batch_tokens} "
                "(transitions must fall on step boundaries)")
        require(0 <= self.lr_end <= self.lr_peak, f"{where}.lr_end={self.lr_end} must be in [0, lr_peak]")
        require(self.rope_theta >= 0, f"{where}.rope_theta={self.rope_theta} must be >= 0")
        check_long_documents(where, self.long_doc_share, self.long_doc_tokens)
        for i, entry in enumerate(self.blend):
            entry.check(f"{where}.blend[{i}]")
        require(0 <= self.warmup_tokens <= self.tokens, f"{where}.warmup_tokens={self.warmup_tokens} must be in "
                f"[0, {where}.tokens]")

    @property
    def rows(self) -> int:
        return self.batch_tokens // self.seq_len

    @property
    def steps(self) -> int:
        return self.tokens // self.batch_tokens


def check_stages(stages: list[StageConfig]) -> None:
    for i, stage in enumerate(stages):
        stage.check(f"stages[{i}]")
        if stage.decay == "run_cosine" and i and stages[i - 1].decay == "run_cosine":
            first = stages[i - 1]
            for key in ("lr_peak", "lr_end"):
                require(getattr(stage, key) == getattr(first, key),
                        f"stages[{i}].{key}={getattr(stage, key)} differs from stages[{i - 1}].{key}="
                        f"{getattr(first, key)}: consecutive run_cosine stages share one schedule")
            require(stage.warmup_tokens == 0, f"stages[{i}].warmup_tokens={stage.warmup_tokens}: a run_cosine "
                    "stage that continues the schedule has no warmup of its own (the span's first stage has it)")
        if i:
            previous = stages[i - 1]
            require(stage.seq_len > previous.seq_len,
                    f"stages[{i}].seq_len={stage.seq_len} must be larger than stages[{i - 1}].seq_len="
                    f"{previous.seq_len} (context only grows)")
