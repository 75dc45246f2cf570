"""Data: byte tokenizer, embedded default corpus (stdlib text + synthetic captioned images), packing."""

from moe_pretrain.data.batch import IGNORE_INDEX, Batch, PretrainingData

__all__ = ["IGNORE_INDEX", "Batch", "PretrainingData"]
