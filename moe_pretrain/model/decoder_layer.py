"""One decoder layer of the backbone (docs/model.md): AttnRes mix, norm and sequence mixer (the layer's kind's:
model/mixers.py), AttnRes mix, norm and MLP (LatentMoE, or the dense SiTU-GLU MLP in the first dense_layers).

The layer reads the AttnRes state (the bank of block sums and the running partial sum of the current block,
model/transformer.py) and returns the partial sum with its two sublayer outputs added.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.model.attn_res import AttnResMix
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mixers import mixer_spec
from moe_pretrain.model.mlp import SiTUGLUMLP
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.saved_inputs import SavedInputs


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, kernels: Kernels = REFERENCES):
        super().__init__()
        d, std = cfg.hidden_size, cfg.init_std
        out_std = std / (2 * cfg.num_layers) ** 0.5
        # Layer 0's attention mix sees a one-entry bank (the embedding) and returns it as it is: its two tensors
        # never get a gradient. They are kept because the released Kimi K3 stores them too
        # (language_model.model.layers.0.self_attention_res_norm / _proj), so import and export map every
        # released tensor one to one; they cost 2d parameters.
        self.attn_mix = AttnResMix(d, cfg.norm_eps, kernels)
        self.attn_norm = RMSNorm(d, cfg.norm_eps, kernels)
        self.mixer = mixer_spec(cfg, index).build(d, cfg, init_std=std, out_std=out_std, kernels=kernels)
        self.mlp_mix = AttnResMix(d, cfg.norm_eps, kernels)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, kernels)
        moe = cfg.moe
        if cfg.is_moe_layer(index):
            self.mlp = LatentMoE(d, moe, norm_eps=cfg.norm_eps, init_std=std, out_std=out_std, kernels=kernels)
        else:
            self.mlp = SiTUGLUMLP(d, cfg.dense_intermediate, beta=moe.situ_beta,
                                  linear_beta=moe.situ_linear_beta, init_std=std, out_std=out_std, kernels=kernels)
        self.index = index
        self.recompute = False
        """Recompute the whole layer in backward (train.recompute=full)."""
        self.recompute_modules: frozenset[str] = frozenset()
        """Of attn_res and norms, those recomputed one region each (train.recompute lists them)."""
        self.saved_inputs = SavedInputs()
        """Where the recomputed layer's inputs wait for its backward (train.saved_inputs; the model's store)."""

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor | None, layout: DocumentLayout
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (new partial block sum, balancing loss or None)."""
        if not self.recompute:
            return self._forward(bank, partial, layout)
        if isinstance(self.mlp, LatentMoE) and self.mlp.recompute_around_exchanges:
            return self._forward_around_exchanges(bank, partial, layout)
        with self.saved_inputs.layer(self.index):  # the bank's tensors as arguments: the checkpoint saves them
            return maybe_recompute(True, self._forward_flat, partial, layout, *bank)

    def _forward_around_exchanges(self, bank, partial, layout):
        """Full recomputation that runs the MoE's expert exchanges once (train.recompute_exchanges=false): the
        layer up to them is recomputed from the layer's inputs, the routed experts from the rows they received,
        the way back to d from the combined rows and the shared experts' output; what the exchanges received
        waits for the backward instead of being fetched again (planning/step_activations.exchanges_kept)."""
        with self.saved_inputs.layer(self.index):
            partial, *routing, shared = maybe_recompute(True, self._to_experts_flat, partial, layout, *bank)
        topk_idx, topk_weight, balance_loss, z_TL = routing
        routed_TL = self.mlp.exchange(z_TL, topk_idx, topk_weight)
        return partial + maybe_recompute(True, self._from_experts, routed_TL, shared, partial.shape), balance_loss

    def _forward_flat(self, partial, layout, *bank):
        return self._forward(list(bank), partial, layout)

    def _to_experts_flat(self, partial, layout, *bank):
        """The layer up to the MoE's exchanges, and its shared experts (which read the same input: computed
        here, that input and its sequence-parallel gather need not wait for the backward)."""
        partial, mlp_in = self._to_mlp(list(bank), partial, layout)
        # Routing first, the shared experts after, as the MoE's forward runs them: their gradients then reach
        # mlp_in in the same order, and its sum is bitwise the one full recomputation makes.
        routing = self.mlp.to_experts(mlp_in)
        return partial, *routing, self.mlp.shared(mlp_in) if self.mlp.shared is not None else None

    def _from_experts(self, routed_TL, shared, shape):
        y = self.mlp.from_experts(routed_TL, shape)
        return y + shared if shared is not None else y

    def _forward(self, bank, partial, layout):
        return self._add_mlp(*self._to_mlp(bank, partial, layout))

    def _to_mlp(self, bank, partial, layout):
        """-> (partial block sum with the sequence mixer's output, the MLP's normed input)."""
        visible = bank if partial is None else [*bank, partial]
        out = self.mixer(self._normed_mix(self.attn_mix, self.attn_norm, visible), layout)
        partial = out if partial is None else partial + out
        return partial, self._normed_mix(self.mlp_mix, self.mlp_norm, [*bank, partial])

    def _normed_mix(self, mix: AttnResMix, norm: RMSNorm, entries: list[torch.Tensor]) -> torch.Tensor:
        """A sublayer's input, norm(mix(entries)), recomputed as train.recompute lists: attn_res keeps the entries
        (which every mix reads: kept once) instead of the mix's copies, norms the mix's output instead of the
        norm's; both, one region from the entries to the normed input. A one-entry mix is its entry."""
        mixes = "attn_res" in self.recompute_modules and len(entries) > 1
        norms = "norms" in self.recompute_modules
        if mixes and norms:
            return maybe_recompute(True, lambda *e: norm(mix(list(e))), *entries)
        return maybe_recompute(norms, norm, maybe_recompute(mixes, lambda *e: mix(list(e)), *entries))

    def _add_mlp(self, partial, mlp_in):
        mlp_out = self.mlp(mlp_in)
        balance_loss = None
        if isinstance(mlp_out, tuple):
            mlp_out, balance_loss = mlp_out
        return partial + mlp_out, balance_loss
