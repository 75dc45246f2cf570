"""A stage boundary in one call: the settings a stage of the schedule changes on the model's modules, applied
where they change.

A stage may change its context-parallel size and MLA's exchange (the activation plan applied again with the
new split: parallel/activation_plan.py), its recomputation and where full
recomputation keeps the layers' inputs (model/recompute.py, model/saved_inputs.py), and MLA's RoPE base. The
groups of every cp size were built at start-up (ParallelContext.context_groups), so a boundary that changes cp
switches in place: tp, pp, ep and the data x context group (gradients, ZeRO-1 shards) stay; only which
positions and which slice of the batch a rank takes change.
"""

from dataclasses import dataclass

from torch import nn

from moe_pretrain.model.mla import GatedMLA
from moe_pretrain.model.saved_inputs import SavedInputs
from parallel.activation_plan import apply_activation_plan, splits_of
from parallel.state import ParallelContext


@dataclass(frozen=True)
class StageModules:
    """What a stage sets on the modules."""

    cp: int = 0
    """Context-parallel size (0: not yet set; the parallel set-up built the model for parallel.cp)."""
    cp_mla: str = ""
    recompute: str = "none"
    saved_inputs: str = "device"
    rope_theta: float = 0.0
    """MLA's RoPE base in force (0: not yet set)."""


class StageSwitch:
    """Keeps a model's modules set for the stage in force. model: this rank's model (every module that runs
    the step, also through a pipeline's chunk views, which share them); exchanges: train.recompute_exchanges."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, exchanges: bool):
        self.model, self.ctx, self.exchanges = model, ctx, exchanges
        self.applied = StageModules()
        self.saved_inputs: SavedInputs | None = None
        """The store of the layers' saved inputs under full recomputation (its ledger: model/saved_inputs.py)."""

    def apply(self, wanted: StageModules) -> None:
        """Set what differs between the stage in force and `wanted`."""
        now = self.applied
        if now.cp != wanted.cp or (wanted.cp > 1 and now.cp_mla != wanted.cp_mla):
            apply_activation_plan(self.model, splits_of(self.ctx, wanted.cp, wanted.cp_mla))
        if (now.recompute, now.saved_inputs) != (wanted.recompute, wanted.saved_inputs):
            self.saved_inputs = self.model.set_recompute(wanted.recompute, wanted.saved_inputs, self.exchanges)
        if now.rope_theta != wanted.rope_theta:
            for module in self.model.modules():
                if isinstance(module, GatedMLA):
                    module.rope_theta = wanted.rope_theta
        self.applied = wanted
