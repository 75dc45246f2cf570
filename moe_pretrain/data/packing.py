"""Packing documents into fixed-length training rows, keeping document boundaries.

A row holds seq_len + 1 tokens (inputs are row[:-1], labels row[1:]). Text documents are cut at row
ends and continue in the next row as a new segment; documents with images are never cut (the rest of
the row is padded instead) so a caption always sees its image. Every position carries the number of
its document within the row, from which the model derives cu_seqlens and attention masks.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Document:
    tokens: np.ndarray
    """int64 ids, images expanded into patch tokens."""
    patches: np.ndarray | None = None
    """[P, patch_dim] float32, one per patch token in order; None for text."""
    origin: tuple[str, int] = ("", -1)
    """(dataset prefix, record): where to read it again when a resumed run needs its rest."""
    offset: int = 0
    """Tokens of the document already packed (a text document cut at a row end)."""

    @property
    def is_image(self) -> bool:
        return self.patches is not None


@dataclass
class PackedRow:
    tokens: np.ndarray
    """[seq_len + 1] int64."""
    doc_ids: np.ndarray
    """[seq_len + 1] int64, non-decreasing."""
    patches: list[np.ndarray]
    """One [patch_dim] array per image patch token of the row, in order."""


class SequencePacker:
    def __init__(self, next_document: Callable[[], Document], seq_len: int, pad_id: int):
        self.next_document = next_document
        self.row_len = seq_len + 1
        self.pad_id = pad_id
        self.pending: Document | None = None
        """The document the next row starts with: the rest of a cut one, or one that did not fit."""

    def _take_document(self) -> Document:
        doc, self.pending = self.pending, None
        return doc if doc is not None else self.next_document()

    def next_row(self) -> PackedRow:
        tokens: list[np.ndarray] = []
        doc_ids: list[np.ndarray] = []
        patches: list[np.ndarray] = []
        length = doc_number = 0
        while length < self.row_len:
            doc = self._take_document()
            space = self.row_len - length
            if doc.is_image and len(doc.tokens) > space:
                if len(doc.tokens) > self.row_len:
                    raise ValueError(f"{doc.origin[0]}: record {doc.origin[1]} has {len(doc.tokens)} tokens with its "
                                     f"images, more than a row of {self.row_len}, and images are never cut")
                self.pending = doc
                tokens.append(np.full(space, self.pad_id, dtype=np.int64))
                doc_ids.append(np.full(space, doc_number, dtype=np.int64))
                break
            taken = doc.tokens[:space]
            if len(doc.tokens) > space:
                self.pending = Document(doc.tokens[space:], None, doc.origin, doc.offset + space)
            tokens.append(taken)
            doc_ids.append(np.full(len(taken), doc_number, dtype=np.int64))
            length += len(taken)
            if doc.is_image:
                patches.extend(doc.patches)
            doc_number += 1
        return PackedRow(np.concatenate(tokens), np.concatenate(doc_ids), patches)
