"""A stage's layout settings resolved once: the keys a stage may set and otherwise takes from the run (cp,
cp_mla, recompute, saved_inputs), with the run's value filled in, and which key gave each (for messages).
Training, the plan, the layout checks and the config's own checks all read them from here."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSettings:
    cp: int
    cp_mla: str
    """As configured (auto, latent, ulysses); what auto resolves to depends on the heads per rank
    (parallel/context_parallel.mla_exchange)."""
    recompute: str
    saved_inputs: str
    cp_key: str
    """The key that set cp: stages[i].cp, or parallel.cp."""
    cp_mla_key: str


def stage_settings(config) -> list[StageSettings]:
    """One per stage of config.stages, or the unstaged run's as its one stage."""
    p, train = config.parallel, config.train
    if not config.stages:
        return [StageSettings(p.cp, p.cp_mla, train.recompute, train.saved_inputs, "parallel.cp", "parallel.cp_mla")]
    return [StageSettings(stage.cp or p.cp, stage.cp_mla or p.cp_mla, stage.recompute or train.recompute,
                          stage.saved_inputs or train.saved_inputs,
                          f"stages[{i}].cp" if stage.cp else "parallel.cp",
                          f"stages[{i}].cp_mla" if stage.cp_mla else "parallel.cp_mla")
            for i, stage in enumerate(config.stages)]
