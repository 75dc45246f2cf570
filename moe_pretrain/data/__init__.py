"""Data: indexed datasets (megatron-core .bin/.idx), blends, the embedded default corpus, packing, batches."""

from moe_pretrain.data.batch import IGNORE_INDEX, Batch, PretrainingData
from moe_pretrain.data.indexed import DataError

__all__ = ["IGNORE_INDEX", "Batch", "DataError", "PretrainingData"]
