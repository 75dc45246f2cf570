"""A stage boundary in one call: what a stage sets on the model's modules, applied where it changes.

A stage may change its context-parallel size and MLA's exchange (the activation plan applied again with the
new split: parallel/activation_plan.py), its recomputation and where full recomputation keeps the layers'
inputs (model/recompute.py, model/saved_inputs.py), and MLA's RoPE base. The groups of every cp size were
built at start-up (ParallelContext.context_groups), so a boundary that changes cp switches in place: tp, pp,
ep and the data x context group (gradients, ZeRO-1 shards) stay; only which positions and which slice of
the batch a rank takes change.
"""

from torch import nn

from moe_pretrain.config.stage import Stage
from moe_pretrain.model.mixer_spec import SequenceMixer
from moe_pretrain.model.saved_inputs import SavedInputs
from parallel.activation_plan import apply_activation_plan, splits_of
from parallel.state import ParallelContext


class StageSwitch:
    """Keeps a model's modules set for the stage in force. model: this rank's model (every module that runs
    the step, also through a pipeline's chunk views, which share them); exchanges: train.recompute_exchanges."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, exchanges: bool):
        self.model, self.ctx, self.exchanges = model, ctx, exchanges
        self.applied: Stage | None = None
        """The stage the modules are set for (None: as the parallel set-up built them, for parallel.cp)."""
        self.saved_inputs: SavedInputs | None = None
        """The store of the layers' saved inputs under full recomputation (its ledger: model/saved_inputs.py)."""

    def apply(self, stage: Stage) -> None:
        """Set what differs between the stage in force and `stage`."""
        now = self.applied
        if now is None or now.cp != stage.cp or (stage.cp > 1 and now.cp_mla != stage.cp_mla):
            apply_activation_plan(self.model, splits_of(self.ctx, stage.cp, stage.cp_mla))
        if now is None or (now.recompute, now.saved_inputs) != (stage.recompute, stage.saved_inputs):
            self.saved_inputs = self.model.set_recompute(stage.recompute, stage.saved_inputs, self.exchanges)
        if now is None or now.rope_theta != stage.rope_theta:
            for module in self.model.modules():
                if isinstance(module, SequenceMixer):
                    module.rope_theta = stage.rope_theta
        self.applied = stage
