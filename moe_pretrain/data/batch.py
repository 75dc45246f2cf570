"""Training batches: packed rows turned into model inputs, labels and masks.

Shape legend: B rows, T = seq_len, P patches in the batch. Labels are -100 (ignored) where the
target is not text (padding, BOS, image tokens) or belongs to another document than the input.
"""

from dataclasses import dataclass

import numpy as np
import torch

from moe_pretrain.config import ConfigError, DataConfig, VisionConfig
from moe_pretrain.data import tokenizer as tok
from moe_pretrain.data.documents import document_stream, longest_image_document
from moe_pretrain.data.packing import PackedRow, SequencePacker

IGNORE_INDEX = -100


@dataclass
class Batch:
    tokens: torch.Tensor
    """[B, T] int64 input ids."""
    labels: torch.Tensor
    """[B, T] int64 next-token targets, IGNORE_INDEX where no loss is taken."""
    doc_ids: torch.Tensor
    """[B, T] int64 document number within each row."""
    image_mask: torch.Tensor
    """[B, T] bool, True at IMAGE_PATCH inputs."""
    patches: torch.Tensor
    """[P, patch_dim] float32, one per True in image_mask, in row-major order."""

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @staticmethod
    def concatenate(batches: list["Batch"]) -> "Batch":
        """Rows of several batches, in order (patches stay in row-major order)."""
        return Batch(*(torch.cat([getattr(b, f) for b in batches]) for f in
                       ("tokens", "labels", "doc_ids", "image_mask", "patches")))

    def patch_rows(self, width: int) -> torch.Tensor:
        """Patches per row, [B, width, patch_dim] zero-padded: a form that splits along the batch
        (pipeline micro-batches), unlike the flat [P, patch_dim]."""
        counts = self.image_mask.sum(dim=1)
        if counts.numel() and int(counts.max()) > width:
            raise ValueError(f"a row holds {int(counts.max())} patches, more than the {width} allowed for")
        rows = self.patches.new_zeros(self.tokens.shape[0], width, self.patches.shape[1])
        rows[torch.arange(rows.shape[1]) < counts.unsqueeze(1)] = self.patches
        return rows

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.labels, self.doc_ids, self.image_mask,
                                                self.patches)))


def rows_to_batch(rows: list[PackedRow], patch_dim: int) -> Batch:
    tokens = np.stack([r.tokens for r in rows])
    doc_ids = np.stack([r.doc_ids for r in rows])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    text_target = np.isin(targets, [*range(256), tok.EOS])
    same_doc = doc_ids[:, 1:] == doc_ids[:, :-1]
    labels = np.where(text_target & same_doc, targets, IGNORE_INDEX)
    image_mask = inputs == tok.IMAGE_PATCH
    patches = []
    for row, mask in zip(rows, image_mask):
        patches.extend(row.patches[: int(mask.sum())])  # a patch at the row's last position is label-only
    patch_array = np.stack(patches).astype(np.float32) if patches else np.zeros((0, patch_dim), np.float32)
    return Batch(
        torch.from_numpy(inputs.copy()), torch.from_numpy(labels), torch.from_numpy(doc_ids[:, :-1].copy()),
        torch.from_numpy(image_mask), torch.from_numpy(patch_array),
    )


class PretrainingData:
    """The default data pipeline: document stream -> packer -> batches of `rows` rows."""

    def __init__(self, cfg: DataConfig, vision: VisionConfig):
        longest = longest_image_document(cfg.image_size, vision)
        if cfg.image_fraction > 0 and longest > cfg.seq_len + 1:
            raise ConfigError(
                f"an image document takes up to {longest} tokens (data.image_size={cfg.image_size}, "
                f"model.vision.patch_size={vision.patch_size}), more than data.seq_len={cfg.seq_len} + 1; "
                "raise data.seq_len, lower data.image_size, or set data.image_fraction=0"
            )
        self.cfg = cfg
        self.patch_dim = vision.patch_dim
        self.packer = SequencePacker(document_stream(cfg, vision), cfg.seq_len)
        self.segments: list[list[int]] = [[cfg.seq_len, 0]]
        """[seq_len, rows] for each stretch of the stream packed at one sequence length: the global,
        layout-independent position of the stream."""

    @property
    def rows_consumed(self) -> int:
        return sum(rows for _, rows in self.segments)

    def set_seq_len(self, seq_len: int) -> None:
        """Pack the following rows at seq_len (a context-extension stage began); documents continue."""
        if seq_len != self.segments[-1][0]:
            self.packer.row_len = seq_len + 1
            self.segments.append([seq_len, 0])

    def skip(self, segments: list[list[int]]) -> None:
        """Fast-forward a fresh stream to a saved position (resume): the stream is deterministic, so
        re-packing the same rows at the same lengths lands exactly where an uninterrupted run was."""
        for seq_len, rows in segments:
            self.set_seq_len(seq_len)
            for _ in range(rows):
                self.packer.next_row()
            self.segments[-1][1] += rows

    def next_batch(self, rows: int, shard: int = 0, num_shards: int = 1) -> Batch:
        """The next `rows` rows of the global stream, or data-parallel shard `shard` of them.

        Every rank packs the same global rows and keeps its contiguous slice, so the global batch,
        and with it the training, is the same for any data-parallel size.
        """
        if rows % num_shards:
            raise ValueError(f"{rows} rows cannot be split into {num_shards} data-parallel shards")
        packed = [self.packer.next_row() for _ in range(rows)]
        self.segments[-1][1] += rows
        per_shard = rows // num_shards
        return rows_to_batch(packed[shard * per_shard:(shard + 1) * per_shard], self.patch_dim)
