"""The embedded default corpus, built into indexed datasets on first use and cached.

Two datasets: the Python standard library's source files cut into documents (stdlib_corpus.py), and
rendered synthetic captioned images (synthetic_images.py). Where a stage draws a share of its tokens from long
documents (long_doc_share), the text also holds LONG_DOCUMENTS documents of that stage's sequence length, the
library's text run on from file to file: the stage then packs documents that fill its rows, as a real blend's
long documents would, rather than 2 KB pieces. Their names carry everything they are made
from, so a cached copy is reused only when it is the same data; concurrent builders (every rank of a
node starts at once) serialise on a file lock and the first one's result is shared.
"""

import fcntl
import hashlib
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moe_pretrain.config import BlendConfig, DataConfig
from moe_pretrain.data.indexed import DatasetWriter, sidecar_path
from moe_pretrain.data.stdlib_corpus import read_document, stdlib_source_files
from moe_pretrain.data.synthetic_images import make_image
from moe_pretrain.data.tokenizer import encode
from moe_pretrain.data.vocabulary import BYTES

log = logging.getLogger(__name__)


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


def cache_root(cfg: DataConfig) -> Path:
    default = Path(os.environ.get("MOE_PRETRAIN_CACHE", Path.home() / ".cache" / "moe-pretrain"))
    return Path(cfg.cache_dir) if cfg.cache_dir else default


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_once(prefix: Path, write) -> Path:
    """Build prefix with write(DatasetWriter) unless a finished copy (its sidecar) is there."""
    if sidecar_path(prefix).is_file():
        return prefix
    with _locked(Path(f"{prefix}.lock")):
        if not sidecar_path(prefix).is_file():
            log.info(f"data: building {prefix} (first use, cached afterwards)")
            writer = DatasetWriter(prefix, BYTES)
            try:
                write(writer)
                writer.finalize()
            except BaseException:
                writer.abort()
                raise
    return prefix


LONG_DOCUMENTS = 8
"""Synthetic long documents of each length asked for (a pool revisits its documents every epoch)."""


def long_text(files: tuple[Path, ...], length: int, index: int) -> bytes:
    """The index-th document of `length` bytes: the library's files run on from one to the next (from the index-th
    file), cycling."""
    pieces, size, at = [], 0, index
    while size < length:
        piece = read_document(files[at % len(files)])
        pieces.append(piece[:length - size])
        size += len(pieces[-1])
        at += 1
    return b"".join(pieces)


def stdlib_text_dataset(cfg: DataConfig, long_lengths: tuple[int, ...] = ()) -> Path:
    """The stdlib text cut into documents of at most data.text_doc_bytes, and LONG_DOCUMENTS documents of each of
    long_lengths tokens."""
    files = stdlib_source_files()
    identity = f"{sys.version}|{files[0].parent}|{len(files)}|{sum(f.stat().st_size for f in files)}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    longs = "".join(f"-long{length}" for length in long_lengths)
    prefix = cache_root(cfg) / f"stdlib-text-{cfg.text_doc_bytes}-{digest}{longs}"

    def write(writer: DatasetWriter) -> None:
        for i, path in enumerate(files):
            for piece in split_text(read_document(path), cfg.text_doc_bytes):
                writer.add(encode(piece), where=f"{path} (file {i})")
        for length in long_lengths:
            for index in range(LONG_DOCUMENTS):
                writer.add(encode(long_text(files, length, index * 97)), where=f"long document {index} of {length}")

    return _build_once(prefix, write)


def to_pixels(image: np.ndarray) -> np.ndarray:
    """[-1, 1] float -> uint8, the stored form (read back as pixels / 127.5 - 1)."""
    return np.clip(np.rint((image + 1.0) * 127.5), 0, 255).astype(np.uint8)


def synthetic_image_dataset(cfg: DataConfig, channels: int) -> Path:
    """Captioned images of four sizes (synthetic_images.image_size), stored at their own sizes."""
    prefix = cache_root(cfg) / f"synthetic-images-v3-{cfg.image_size}-{channels}-{cfg.seed}-{cfg.embedded_images}"

    def write(writer: DatasetWriter) -> None:
        for index in range(cfg.embedded_images):
            image, caption = make_image(cfg.seed, index, cfg.image_size, channels)
            writer.add([BYTES.image_start, BYTES.image_end, *encode(caption)], [to_pixels(image)])

    return _build_once(prefix, write)


def embedded_blend(cfg: DataConfig, channels: int, long_lengths: tuple[int, ...] = ()) -> list[BlendConfig]:
    """data.blend for the embedded corpus: stdlib text (with long documents of each of long_lengths tokens) and,
    by token share image_fraction, images."""
    blend = []
    if cfg.image_fraction < 1:
        blend.append(BlendConfig(str(stdlib_text_dataset(cfg, long_lengths)), 1.0 - cfg.image_fraction))
    if cfg.image_fraction > 0:
        blend.append(BlendConfig(str(synthetic_image_dataset(cfg, channels)), cfg.image_fraction))
    return blend
