"""Packing documents into fixed-length training rows, keeping document boundaries, from lengths alone.

A row holds seq_len + 1 tokens (inputs are row[:-1], labels row[1:]). Text documents are cut at row
ends and continue in the next row as a new segment; documents with images are never cut (the rest of
the row is padded instead) so a caption always sees its image. Every position carries the number of
its document within the row, from which the model derives cu_seqlens and attention masks.

The packer sees only where documents come from and how long they are (known from the index, images
counted by the tokens they become), never their tokens: every data-parallel rank plans the rows of the whole
global batch for a few integer operations per document, and reads (and cuts images into patches for)
only its own rows (batch.py).
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DocumentRef:
    """A document still to be packed, or the rest of one."""

    origin: tuple[str, int]
    """(dataset prefix, record): where to read it."""
    length: int
    """Tokens left to pack, images expanded into their tokens."""
    is_image: bool
    offset: int = 0
    """Tokens of the document already packed (a text document cut at a row end)."""


@dataclass(frozen=True)
class Segment:
    """tokens[offset : offset + length] of a document, at the next positions of a row."""

    origin: tuple[str, int]
    offset: int
    length: int
    is_image: bool


@dataclass
class RowPlan:
    segments: list[Segment]
    padding: int
    """Pad tokens closing the row (an image document that did not fit the space left)."""


@dataclass
class PackedRow:
    tokens: np.ndarray
    """[seq_len + 1] int64."""
    doc_ids: np.ndarray
    """[seq_len + 1] int64, non-decreasing."""
    patches: list[np.ndarray]
    """One [patches, patch_dim] array per document with images, in order (empty where pixels are not read)."""
    grids: list[tuple[int, int, int]]
    """The (t, h, w) patch grid of each image of the row, in order (known with or without pixels)."""


class SequencePacker:
    def __init__(self, next_document: Callable[[], DocumentRef], seq_len: int):
        self.next_document = next_document
        self.row_len = seq_len + 1
        self.pending: DocumentRef | None = None
        """The document the next row starts with: the rest of a cut one, or one that did not fit."""

    def _take_document(self) -> DocumentRef:
        doc, self.pending = self.pending, None
        return doc if doc is not None else self.next_document()

    def next_row(self) -> RowPlan:
        segments: list[Segment] = []
        length = 0
        while length < self.row_len:
            doc = self._take_document()
            space = self.row_len - length
            if doc.is_image and doc.length > space:
                if doc.length > self.row_len:
                    raise ValueError(f"{doc.origin[0]}: record {doc.origin[1]} has {doc.length} tokens with its "
                                     f"images, more than a row of {self.row_len}, and images are never cut")
                self.pending = doc
                return RowPlan(segments, space)
            taken = min(doc.length, space)
            if doc.length > space:
                self.pending = DocumentRef(doc.origin, doc.length - space, False, doc.offset + space)
            segments.append(Segment(doc.origin, doc.offset, taken, doc.is_image))
            length += taken
        return RowPlan(segments, 0)


def assemble_row(plan: RowPlan, read: Callable[[tuple[str, int]], tuple[np.ndarray, np.ndarray | None, list]],
                 pad_id: int) -> PackedRow:
    """The row a plan describes; read(origin) -> (tokens, patches or None, image grids) of a whole document
    (a document with images is always whole in one segment)."""
    tokens: list[np.ndarray] = []
    doc_ids: list[np.ndarray] = []
    patches: list[np.ndarray] = []
    grids: list[tuple[int, int, int]] = []
    for number, segment in enumerate(plan.segments):
        document, document_patches, document_grids = read(segment.origin)
        tokens.append(document[segment.offset:segment.offset + segment.length])
        doc_ids.append(np.full(segment.length, number, dtype=np.int64))
        grids += document_grids
        if document_patches is not None:
            patches.append(document_patches)
    if plan.padding:
        tokens.append(np.full(plan.padding, pad_id, dtype=np.int64))
        doc_ids.append(np.full(plan.padding, len(plan.segments), dtype=np.int64))
    return PackedRow(np.concatenate(tokens), np.concatenate(doc_ids), patches, grids)
