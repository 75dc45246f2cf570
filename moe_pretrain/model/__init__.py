"""The model: modules over the functional core in moe_pretrain.ops. It communicates nothing and knows no layout
(parallel/activation_plan.py places its activations)."""

from moe_pretrain.model.decoder_layer import DecoderLayer
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.transformer import MoETransformer

__all__ = ["DecoderLayer", "DocumentLayout", "MoETransformer"]
