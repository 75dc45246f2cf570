"""The document stream: stdlib text files and captioned images, mixed to a target token share.

Text document: [BOS] bytes [EOS]. Image document: [BOS] [IMAGE_START] [PATCH] * P [IMAGE_END]
caption bytes [EOS], with the P flattened patches carried beside the tokens. Text files are visited
in a fresh seeded permutation every epoch; the stream is infinite and deterministic from data.seed.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moe_pretrain.config import DataConfig, VisionConfig
from moe_pretrain.data import tokenizer as tok
from moe_pretrain.data.patches import patchify
from moe_pretrain.data.stdlib_corpus import read_document, stdlib_source_files
from moe_pretrain.data.synthetic_images import longest_caption_bytes, make_image


@dataclass
class Document:
    tokens: list[int]
    patches: np.ndarray | None = None
    """[P, patch_dim] float32 for an image document, in the order of its PATCH tokens."""

    @property
    def is_image(self) -> bool:
        return self.patches is not None


def split_text(data: bytes, max_bytes: int) -> list[bytes]:
    """Cut data into pieces of at most max_bytes, at the last line break of each piece when there is one."""
    pieces = []
    while len(data) > max_bytes:
        cut = data.rfind(b"\n", 0, max_bytes) + 1 or max_bytes
        pieces.append(data[:cut])
        data = data[cut:]
    if data:
        pieces.append(data)
    return pieces


def text_documents(seed: int, max_bytes: int) -> Iterator[Document]:
    files = stdlib_source_files()
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(files))
        for i in order:
            for piece in split_text(read_document(files[i]), max_bytes):
                yield Document([tok.BOS, *tok.encode(piece), tok.EOS])
        epoch += 1


def shuffled(documents: Iterator[Document], buffer_size: int, seed: int) -> Iterator[Document]:
    """A seeded shuffle buffer: consecutive pieces of one file are spread over many batches."""
    rng = np.random.default_rng([seed, 2])
    buffer: list[Document] = []
    for doc in documents:
        if len(buffer) < buffer_size:
            buffer.append(doc)
            continue
        i = int(rng.integers(buffer_size))
        yield buffer[i]
        buffer[i] = doc


IMAGE_DOC_OVERHEAD = 4
"""BOS, IMAGE_START, IMAGE_END and EOS around an image document's patches and caption."""


def longest_image_document(image_size: int, vision: VisionConfig) -> int:
    """Tokens of the longest image document: it must fit one packed row, since images are never cut."""
    return (image_size // vision.patch_size) ** 2 + longest_caption_bytes() + IMAGE_DOC_OVERHEAD


def image_documents(seed: int, image_size: int, vision: VisionConfig) -> Iterator[Document]:
    index = 0
    while True:
        image, caption = make_image(seed, index, image_size, vision.channels)
        patches = patchify(image, vision.patch_size)
        tokens = [tok.BOS, tok.IMAGE_START, *[tok.IMAGE_PATCH] * len(patches), tok.IMAGE_END,
                  *tok.encode(caption), tok.EOS]
        yield Document(tokens, patches)
        index += 1


def document_stream(cfg: DataConfig, vision: VisionConfig) -> Iterator[Document]:
    """Interleave text and image documents so image tokens stay near image_fraction of all tokens.

    Mixing by token share, not document count: one stdlib file is worth hundreds of captioned images.
    """
    texts = shuffled(text_documents(cfg.seed, cfg.text_doc_bytes), cfg.shuffle_buffer, cfg.seed)
    images = image_documents(cfg.seed, cfg.image_size, vision)
    image_tokens = total_tokens = 0
    while True:
        wants_image = cfg.image_fraction > 0 and image_tokens <= cfg.image_fraction * total_tokens
        doc = next(images) if wants_image else next(texts)
        image_tokens += len(doc.tokens) if doc.is_image else 0
        total_tokens += len(doc.tokens)
        yield doc
