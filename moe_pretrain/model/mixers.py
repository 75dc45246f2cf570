"""The sequence mixers' specs by kind, and the two look-ups every reader of a mixer uses.

A layer's kind comes from its letter in model.layer_pattern (config/model.MIXER_LETTERS); its spec
(model/mixer_spec.py) from MIXERS. A new mixer is its module, its spec and one entry here and in MIXER_LETTERS
(docs/extension.md, "A sequence mixer").
"""

from torch import nn

from moe_pretrain.config import ModelConfig
from moe_pretrain.model.kda_spec import KDA
from moe_pretrain.model.mixer_spec import MixerSpec
from moe_pretrain.model.mla_spec import MLA

MIXERS: dict[str, MixerSpec] = {KDA.kind: KDA, MLA.kind: MLA}


def mixer_spec(m: ModelConfig, index: int) -> MixerSpec:
    """Layer `index`'s mixer (a multi-token-prediction block's layer from num_layers on)."""
    kind = m.layer_kind(index)
    if kind not in MIXERS:
        raise KeyError(f"model.layer_pattern names mixer {kind!r}, which has no spec in model/mixers.MIXERS")
    return MIXERS[kind]


def spec_of_module(module: nn.Module) -> MixerSpec | None:
    """The spec whose module `module` is, or None: not a sequence mixer."""
    return next((spec for spec in MIXERS.values() if isinstance(module, spec.module)), None)
