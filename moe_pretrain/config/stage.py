"""A stage of the run, resolved once: what its steps do and which config key set each figure.

A staged run (config.stages) has one Stage per entry; an unstaged one has a single Stage of data.*'s shape.
Every figure a stage may leave to the run is filled in here and nowhere else: cp, cp_mla, recompute and
saved_inputs from the run's keys, micro_batches derived where the config leaves 0, MLA's exchange under
context parallelism chosen for `auto`, the RoPE base from model.mla where the stage sets none. The layout
resolution (parallel/state.resolve_layout) builds them at start and checks them; the trainer, the stage
switch, the pipeline, the prefetcher, the memory planner and the dry run take a Stage as it is.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class StageKeys:
    """The config keys that set a stage's figures, named in messages."""

    seq_len: str
    """stages[i].seq_len, or data.seq_len."""
    rows: str
    """The global batch in words naming its key."""
    micro_batches: str
    cp: str
    """stages[i].cp where the stage sets it, else parallel.cp."""
    cp_mla: str


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    start_tokens: int
    """Tokens consumed before the stage begins."""
    end_tokens: int | None
    """Tokens consumed when it ends (None: an unstaged run, which ends at train.steps)."""
    seq_len: int
    rows: int
    """Global sequences per optimizer step."""
    micro_batches: int
    """Micro-batches per step, never 0 (derived where the config leaves 0: derived_micro_batches)."""
    cp: int
    cp_mla: str
    """MLA's exchange under context parallelism: ulysses or latent (auto chosen: mla_exchange)."""
    recompute: str
    saved_inputs: str
    rope_theta: float
    """MLA's RoPE base in force."""
    keys: StageKeys

    @property
    def batch_tokens(self) -> int:
        return self.rows * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps of a staged run's stage (0 for an unstaged run's)."""
        return (self.end_tokens - self.start_tokens) // self.batch_tokens if self.end_tokens is not None else 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(seq_len, rows, micro_batches, cp): what a pipeline's boundaries are declared from."""
        return self.seq_len, self.rows, self.micro_batches, self.cp

    def describe(self) -> str:
        """The layout part in a few words: cp=4 latent full/host M=8."""
        kept = f"/{self.saved_inputs}" if self.saved_inputs != "device" else ""
        exchange = " latent" if self.cp > 1 and self.cp_mla == "latent" else ""
        return f"cp={self.cp}{exchange} {self.recompute}{kept} M={self.micro_batches}"


def mla_exchange(method: str, cp: int, heads: int) -> str:
    """The MLA exchange a cp_mla setting gives at context-parallel size cp with `heads` MLA heads on a
    tensor-parallel rank: auto takes Ulysses where the heads divide (its all-to-alls move each token's
    q, k, v and output once and expand nothing twice), the latent exchange otherwise."""
    if method == "auto":
        return "ulysses" if heads % cp == 0 else "latent"
    return method


def resolve_stages(config) -> tuple[Stage, ...]:
    """One Stage per entry of config.stages, or the unstaged run's (data.*) as its one stage."""
    p, train, d = config.parallel, config.train, config.data
    heads = config.model.mla.num_heads // p.tp
    if not config.stages:
        keys = StageKeys("data.seq_len", f"data.batch_size={d.batch_size}", "data.micro_batches", "parallel.cp",
                         "parallel.cp_mla")
        return (Stage(0, "main", 0, None, d.seq_len, d.batch_size, d.micro_batches or p.pp, p.cp,
                      mla_exchange(p.cp_mla, p.cp, heads), train.recompute, train.saved_inputs,
                      config.model.mla.rope_theta, keys),)
    stages, start = [], 0
    for i, entry in enumerate(config.stages):
        cp = entry.cp or p.cp
        keys = StageKeys(f"stages[{i}].seq_len", f"stages[{i}]: {entry.rows} sequences per step",
                         f"stages[{i}].micro_batches", f"stages[{i}].cp" if entry.cp else "parallel.cp",
                         f"stages[{i}].cp_mla" if entry.cp_mla else "parallel.cp_mla")
        stages.append(Stage(i, entry.name, start, start + entry.tokens, entry.seq_len, entry.rows,
                            entry.micro_batches or p.pp, cp, mla_exchange(entry.cp_mla or p.cp_mla, cp, heads),
                            entry.recompute or train.recompute, entry.saved_inputs or train.saved_inputs,
                            entry.rope_theta or config.model.mla.rope_theta, keys))
        start += entry.tokens
    return tuple(stages)


def derived_micro_batches(config, stages: tuple[Stage, ...]) -> list[str]:
    """The micro-batch counts resolve_stages derived for `stages` (the config left them at 0), in words.

    The smallest count the schedules accept: 1 without pipeline parallelism, else parallel.pp (schedules
    run whole rounds of pp micro-batches; any valid count is a multiple of pp, and when pp micro-batches do
    not divide the data-parallel rows, no multiple does: the layout check then names the keys).
    """
    pp = config.parallel.pp
    why = "no pipeline parallelism" if pp == 1 else f"the smallest count for parallel.pp={pp}: one round"
    configured = [stage.micro_batches for stage in config.stages] or [config.data.micro_batches]
    return [f"{stage.keys.micro_batches}={pp} ({why})"
            for stage, count in zip(stages, configured, strict=True) if not count]
