"""A stage's settings resolved once: its step shape (sequence length, global rows, micro-batches) and the
layout keys a stage may set and otherwise takes from the run (cp, cp_mla, recompute, saved_inputs), with the
run's value filled in, and which key gave each (for messages). An unstaged run is one stage of data.*'s shape.
Training, the plan, the layout checks (parallel/layout_rules.py) and the config's own checks read them here."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSettings:
    seq_len: int
    rows: int
    """Global sequences per optimizer step."""
    micro_batches: int
    """As configured: 0 = derived from the layout (parallel/state.derive_micro_batches)."""
    cp: int
    cp_mla: str
    """As configured (auto, latent, ulysses); what auto resolves to depends on the heads per rank
    (parallel/context_parallel.mla_exchange)."""
    recompute: str
    saved_inputs: str
    seq_key: str
    """The key that set seq_len: stages[i].seq_len, or data.seq_len."""
    rows_text: str
    """The global batch in words naming its key."""
    micro_key: str
    cp_key: str
    """The key that set cp: stages[i].cp, or parallel.cp."""
    cp_mla_key: str


def stage_settings(config) -> list[StageSettings]:
    """One per stage of config.stages, or the unstaged run's (data.*) as its one stage."""
    p, train, d = config.parallel, config.train, config.data
    if not config.stages:
        return [StageSettings(d.seq_len, d.batch_size, d.micro_batches, p.cp, p.cp_mla, train.recompute,
                              train.saved_inputs, "data.seq_len", f"data.batch_size={d.batch_size}",
                              "data.micro_batches", "parallel.cp", "parallel.cp_mla")]
    return [StageSettings(stage.seq_len, stage.rows, stage.micro_batches, stage.cp or p.cp, stage.cp_mla or p.cp_mla,
                          stage.recompute or train.recompute, stage.saved_inputs or train.saved_inputs,
                          f"stages[{i}].seq_len", f"stages[{i}]: {stage.rows} sequences per step",
                          f"stages[{i}].micro_batches",
                          f"stages[{i}].cp" if stage.cp else "parallel.cp",
                          f"stages[{i}].cp_mla" if stage.cp_mla else "parallel.cp_mla")
            for i, stage in enumerate(config.stages)]
