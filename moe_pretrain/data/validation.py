"""Validation batches: per dataset, a fixed set of held-out rows at a given sequence length.

Each validation dataset (eval.blend's, or every training dataset's held-out documents, heldout.py) gives
the rows its documents make when packed in record order, as many as eval.tokens needs at the sequence
length in force; an evaluation always sees the same rows for a stage, so its values are comparable over
time. The rows are padded with empty ones (no loss token) to a multiple of the data-parallel size and each
rank reads its contiguous share, so the summed loss and token count, and the loss, do not depend on the
layout.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_pretrain.data.batch import Batch, PretrainingData
from moe_pretrain.data.packing import RowPlan, SequencePacker


@dataclass
class ValidationSet:
    name: str
    """What metrics call it: eval_loss.<name>."""
    path: str
    records: np.ndarray
    """The records it packs, in order (cycled if they hold fewer tokens than asked for)."""


class ValidationData:
    def __init__(self, data: PretrainingData):
        self.data = data
        evaluation = data.cfg.eval
        if evaluation.blend:
            for entry in evaluation.blend:
                data.open_dataset(entry.path, entry.tokenizer)
            sources = [(entry.path, np.arange(len(data.datasets[entry.path]))) for entry in evaluation.blend]
        else:
            sources = sorted(data.held_out.items())
        names = [Path(data.names.get(path, path)).name for path, _ in sources]
        if len(set(names)) < len(names):  # two datasets of one file name in different directories
            names = [data.names.get(path, path) for path, _ in sources]
        self.sets = [ValidationSet(name, path, records) for name, (path, records) in zip(names, sources)]
        self.tokens = evaluation.tokens

    def rows(self, seq_len: int) -> int:
        """Rows per dataset at this sequence length, before padding."""
        return math.ceil(self.tokens / seq_len)

    def _plans(self, validation: ValidationSet, seq_len: int, rows: int) -> list[RowPlan]:
        wanted = self.rows(seq_len)
        order = iter(np.resize(validation.records, max(len(validation.records), 1) * (wanted + 1)))
        packer = SequencePacker(lambda: self.data.reference(validation.path, int(next(order))), seq_len)
        plans = [packer.next_row() for _ in range(wanted)]
        return plans + [RowPlan([], seq_len + 1)] * (rows - wanted)

    def batches(self, seq_len: int, shard: int, num_shards: int, rows_per_batch: int, with_patches: bool = True,
                rows: int = 0) -> dict[str, list[Batch]]:
        """This rank's validation rows of every dataset, in batches of at most rows_per_batch rows; `rows`:
        the padded row count (>= rows(seq_len), divisible by num_shards; default rows(seq_len))."""
        rows = rows or self.rows(seq_len)
        per_shard = rows // num_shards
        out = {}
        for validation in self.sets:
            mine = self._plans(validation, seq_len, rows)[shard * per_shard:(shard + 1) * per_shard]
            out[validation.name] = [self.data.read_rows(mine[i:i + rows_per_batch], with_patches)
                                    for i in range(0, len(mine), rows_per_batch)]
        return out
