"""Packing documents into fixed-length training rows, keeping document boundaries.

A row holds seq_len + 1 tokens (inputs are row[:-1], labels row[1:]). Text documents are cut at row
ends and continue in the next row as a new segment; image documents are never cut (the rest of the
row is padded instead) so a caption always sees its image. Every position carries the number of its
document within the row, from which the model derives cu_seqlens and attention masks.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moe_pretrain.data import tokenizer as tok
from moe_pretrain.data.documents import Document


@dataclass
class PackedRow:
    tokens: np.ndarray
    """[seq_len + 1] int64."""
    doc_ids: np.ndarray
    """[seq_len + 1] int64, non-decreasing."""
    patches: list[np.ndarray]
    """One [patch_dim] array per IMAGE_PATCH token of the row, in order."""


class SequencePacker:
    def __init__(self, documents: Iterator[Document], seq_len: int):
        self.documents = documents
        self.row_len = seq_len + 1
        self._pending: Document | None = None

    def _next_document(self) -> Document:
        doc, self._pending = self._pending, None
        return doc if doc is not None else next(self.documents)

    def next_row(self) -> PackedRow:
        tokens: list[int] = []
        doc_ids: list[int] = []
        patches: list[np.ndarray] = []
        doc_number = 0
        while len(tokens) < self.row_len:
            doc = self._next_document()
            space = self.row_len - len(tokens)
            if doc.is_image and len(doc.tokens) > space:
                if len(doc.tokens) > self.row_len:
                    raise ValueError(f"an image document of {len(doc.tokens)} tokens cannot fit a row of "
                                     f"{self.row_len}; raise data.seq_len or lower data.image_size")
                self._pending = doc
                tokens.extend([tok.PAD] * space)
                doc_ids.extend([doc_number] * space)
                break
            taken = doc.tokens[:space]
            if len(doc.tokens) > space:
                self._pending = Document(doc.tokens[space:])
            tokens.extend(taken)
            doc_ids.extend([doc_number] * len(taken))
            if doc.is_image:
                patches.extend(doc.patches)
            doc_number += 1
        return PackedRow(np.array(tokens, dtype=np.int64), np.array(doc_ids, dtype=np.int64), patches)
