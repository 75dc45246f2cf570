"""The dry run's section: what `python -m launch.dryrun` assumes where the model's arithmetic would decide."""

from dataclasses import dataclass, field

from moe_pretrain.config.errors import require


@dataclass
class DryRunConfig:
    expert_load: list[float] = field(default_factory=list)
    """Each routed expert's load relative to the mean, one per expert (model.moe.num_experts), the same on
    every MoE layer and rank (planning/assumed_values.py); empty: balanced. A skew such as 2 on one expert
    in 8 shows what a hot expert costs in all-to-all bytes and the receiving rank's memory."""

    def __post_init__(self) -> None:
        require(all(load > 0 for load in self.expert_load),
                f"dry_run.expert_load={self.expert_load} must hold positive factors")
