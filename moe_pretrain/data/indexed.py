"""Our datasets on disk: Megatron indexed datasets (.bin/.idx, read and written by megatron-core) plus a
JSON sidecar, so any Megatron tool can read the tokens and we can check every file before training.

A dataset with prefix P is:
- P.bin / P.idx: one sequence per document, the document's body: tokenizer ids, with an
  IMAGE_START, IMAGE_END pair where each image goes (the packer expands it into patch tokens, so a
  dataset does not depend on the model's patch size). BOS / EOS are added when documents are read.
- P.images.bin / P.images.idx (only when there are images): uint8 pixels [C, H, W] (a clip: [t, C, H, W]),
  one sequence per image, its documents aligned with the token documents; P.images.shapes.npy: each image's
  (t, C, H, W), int32 [images, 4]: images keep their own sizes (native resolution).
- P.json: the vocabulary, channels and counts. Written last: a dataset without it is unfinished.
Datasets of the first format (FORMAT_V1: every image one shape, recorded in the sidecar) are still read.
"""

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, IndexedDataset, IndexedDatasetBuilder

from moe_pretrain.data.tokenizers import load_tokenizer
from moe_pretrain.data.vocabulary import Vocabulary

FORMAT = "moe-pretrain-indexed-v2"
FORMAT_V1 = "moe-pretrain-indexed-v1"


class DataError(ValueError):
    """A dataset file that cannot be trained on: names the file and, where one is at fault, the record."""


def _paths(prefix: str | Path, part: str = "") -> tuple[Path, Path]:
    base = f"{prefix}{part}"
    return Path(base + ".bin"), Path(base + ".idx")


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.json")


def shapes_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.images.shapes.npy")


class DatasetWriter:
    """Writes a dataset under temporary names and renames it into place, sidecar last, in finalize()."""

    def __init__(self, prefix: str | Path, vocabulary: Vocabulary):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.vocabulary = vocabulary
        self.token_dtype = DType.optimal_dtype(vocabulary.size)
        self._tmp = Path(f"{prefix}.tmp")
        self._tokens = IndexedDatasetBuilder(str(_paths(self._tmp)[0]), dtype=self.token_dtype)
        self._images = IndexedDatasetBuilder(str(_paths(self._tmp, ".images")[0]), dtype=np.uint8)
        self.channels: int | None = None
        self.shapes: list[tuple[int, int, int, int]] = []
        """(t, C, H, W) of every image written."""
        self.documents = self.tokens = self.image_count = 0

    def add(self, body: list[int] | np.ndarray, images: list[np.ndarray] = (), where: str = "") -> None:
        """One document: its body ids (IMAGE_START, IMAGE_END where each image goes) and its images,
        uint8 [C, H, W] or clips [t, C, H, W], of any size but one channel count per dataset. `where` names
        the input record in errors."""
        body = np.asarray(body, dtype=np.int64)
        where = where or f"document {self.documents}"
        if body.size and (body.min() < 0 or body.max() >= self.vocabulary.size):
            raise DataError(f"{where}: token id {int(body.max())} is outside the vocabulary of {self.vocabulary.size}")
        markers = int((body == self.vocabulary.image_start).sum())
        if markers != len(images) or markers != int((body == self.vocabulary.image_end).sum()):
            raise DataError(f"{where}: {len(images)} images but {markers} image markers in the text")
        for image in images:
            if image.dtype != np.uint8 or image.ndim not in (3, 4) or 0 in image.shape:
                raise DataError(f"{where}: an image must be uint8 [C, H, W] or a clip [t, C, H, W] with no empty "
                                f"side, got {image.dtype} {list(image.shape)}")
            shape = (1, *image.shape) if image.ndim == 3 else image.shape
            self.channels = self.channels or shape[1]
            if shape[1] != self.channels:
                raise DataError(f"{where}: an image of {shape[1]} channels, but this dataset's have {self.channels}")
            self.shapes.append(tuple(int(n) for n in shape))
            self._images.add_item(torch.from_numpy(np.ascontiguousarray(image).reshape(-1)))
        self._images.end_document()
        self._tokens.add_document(body, [body.size])  # megatron converts with numpy.array: pass one
        self.documents += 1
        self.tokens += body.size
        self.image_count += len(images)

    def abort(self) -> None:
        """Remove the temporary files of a write that failed (nothing under the final names was touched)."""
        for builder in (self._tokens, self._images):
            builder.data_file.close()
        for part in ("", ".images"):
            for tmp in _paths(self._tmp, part):
                tmp.unlink(missing_ok=True)
        shapes_path(self._tmp).unlink(missing_ok=True)

    def finalize(self) -> Path:
        if not self.documents:
            raise DataError(f"{self.prefix}: no documents were written (empty input)")
        self._tokens.finalize(str(_paths(self._tmp)[1]))
        self._images.finalize(str(_paths(self._tmp, ".images")[1]))
        if self.image_count:
            np.save(shapes_path(self._tmp), np.asarray(self.shapes, dtype=np.int32).reshape(-1, 4))
            os.replace(shapes_path(self._tmp), shapes_path(self.prefix))
        parts = [""] + ([".images"] if self.image_count else [])
        for part in parts:
            for tmp, final in zip(_paths(self._tmp, part), _paths(self.prefix, part)):
                os.replace(tmp, final)
        if not self.image_count:
            for tmp in _paths(self._tmp, ".images"):
                tmp.unlink()
        sidecar = {"format": FORMAT, "vocabulary": self.vocabulary.to_dict(),
                   "image_channels": self.channels, "documents": self.documents, "tokens": self.tokens,
                   "images": self.image_count}
        tmp_sidecar = Path(f"{self._tmp}.json")
        tmp_sidecar.write_text(json.dumps(sidecar, indent=1) + "\n")
        os.replace(tmp_sidecar, sidecar_path(self.prefix))
        return self.prefix


def _open_indexed(prefix: str, expected_documents: int | None, dtype: type | None) -> IndexedDataset:
    """megatron-core's reader, after checks that turn its asserts (or a crash) into errors naming the file
    (the document count and token type only where a sidecar gives them)."""
    bin_path, idx_path = _paths(prefix)
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise DataError(f"{path}: missing")
    with idx_path.open("rb") as index_file:
        if index_file.read(len(_INDEX_HEADER)) != _INDEX_HEADER:
            raise DataError(f"{idx_path}: not a readable Megatron index (bad header)")
    if bin_path.stat().st_size == 0:  # megatron-core cannot map it, and its half-built reader's destructors raise
        raise DataError(f"{bin_path}: empty (0 bytes): the dataset {prefix} holds no tokens")
    try:
        dataset = IndexedDataset(prefix, mmap=True)
    except (AssertionError, ValueError, OSError) as err:
        raise DataError(f"{idx_path}: not a readable Megatron index ({err or type(err).__name__})") from err
    index = dataset.index
    if dtype is not None and index.dtype != dtype:
        raise DataError(f"{idx_path}: tokens are {np.dtype(index.dtype).name}, expected {np.dtype(dtype).name}")
    if expected_documents is not None and len(index.document_indices) - 1 != expected_documents:
        raise DataError(f"{idx_path}: {len(index.document_indices) - 1} documents, but {prefix}.json records "
                        f"{expected_documents}: the .idx does not belong to this dataset")
    expected_bytes = int(index.sequence_lengths.astype(np.int64).sum()) * index.dtype_size
    actual = bin_path.stat().st_size
    if actual != expected_bytes:
        ends = np.cumsum(index.sequence_lengths.astype(np.int64)) * index.dtype_size
        first_bad = int(np.searchsorted(ends, actual, side="right"))
        raise DataError(f"{bin_path}: {actual} bytes, but {idx_path} describes {expected_bytes} (truncated or does "
                        f"not match the index); first incomplete record: {first_bad}")
    return dataset


@dataclass
class Document:
    tokens: np.ndarray
    """int64 ids, BOS ... EOS, image markers not yet expanded."""
    images: list[np.ndarray]
    """uint8 [C, H, W] (a clip: [t, C, H, W]) per IMAGE_START of tokens."""


class IndexedDocuments:
    """A dataset opened for training: checked against its sidecar, documents read on demand. A plain Megatron
    .bin / .idx pair (no sidecar: made by Megatron-LM's tools) is read with the tokenizer the config names;
    a document made of several sequences (sentence-split) is read as their concatenation."""

    def __init__(self, prefix: str | Path, tokenizer: str = ""):
        self.prefix = str(prefix)
        self.plain = False
        """A Megatron dataset without our sidecar: its ids are all the tokenizer's (no specials)."""
        sidecar = sidecar_path(prefix)
        if sidecar.is_file():
            self._read_sidecar(sidecar)
            self._refuse_empty()
            self.tokens = _open_indexed(self.prefix, self.num_documents, DType.optimal_dtype(self.vocabulary.size))
        else:
            self._plain(sidecar, tokenizer)
            self._refuse_empty()
        self.images = None
        self.image_shapes = np.zeros((0, 4), dtype=np.int64)
        """(t, C, H, W) of every image, in record order."""
        if self.image_count:
            self.images = _open_indexed(self.prefix + ".images", self.num_documents, np.uint8)
            self.image_shapes = self._read_shapes()

    def _read_shapes(self) -> np.ndarray:
        """Every image's (t, C, H, W): the shapes file (or, in the first format, the sidecar's one shape), checked
        against the pixels the image index holds."""
        if self.v1_shape is not None:
            shapes = np.tile(np.asarray((1, *self.v1_shape), dtype=np.int64), (self.image_count, 1))
        else:
            path = shapes_path(self.prefix)
            try:
                shapes = np.load(path, allow_pickle=False).astype(np.int64)
            except (OSError, ValueError) as err:
                raise DataError(f"{path}: missing or unreadable ({err})") from err
            if shapes.shape != (self.image_count, 4):
                raise DataError(f"{path}: shapes {list(shapes.shape)}, but {self.prefix}.json records "
                                f"{self.image_count} images")
        pixels = self.images.index.sequence_lengths.astype(np.int64)
        bad = np.flatnonzero(shapes.prod(axis=1) != pixels) if len(pixels) == len(shapes) else [0]
        if len(bad):
            document = int(np.searchsorted(self.images.index.document_indices, bad[0], side="right")) - 1
            raise DataError(f"{self.prefix}.images.bin: record {document} has an image of {int(pixels[bad[0]])} "
                            f"values, its shape {shapes[bad[0]].tolist()} says {int(shapes[bad[0]].prod())}")
        return shapes

    @property
    def channels(self) -> int | None:
        return int(self.image_shapes[0, 1]) if len(self.image_shapes) else None

    def _refuse_empty(self) -> None:
        if self.num_documents == 0:
            raise DataError(f"{self.prefix}: the dataset is empty (0 documents)")

    def _read_sidecar(self, sidecar: Path) -> None:
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("format") not in (FORMAT, FORMAT_V1):
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            self.vocabulary = Vocabulary(**meta["vocabulary"])
            self.v1_shape = tuple(meta["image_shape"]) if meta["format"] == FORMAT_V1 and meta["image_shape"] \
                else None
            self.image_count = int(meta["images"])
            self.num_documents = int(meta["documents"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{sidecar}: not a valid dataset description: {err}") from err

    def _plain(self, sidecar: Path, tokenizer: str) -> None:
        if not all(path.is_file() for path in _paths(self.prefix)):
            raise DataError(f"{sidecar}: missing; {self.prefix} is not a dataset written by "
                            "moe_pretrain.data.preprocess, or its writing did not finish (nor a Megatron .bin / .idx)")
        if not tokenizer:
            raise DataError(f"{sidecar}: missing; {self.prefix} is not a dataset written by "
                            "moe_pretrain.data.preprocess, or its writing did not finish; if it is a Megatron "
                            ".bin / .idx pair, set data.tokenizer (or this blend entry's tokenizer) to the tokenizer "
                            "it was made with")
        try:
            self.vocabulary = load_tokenizer(tokenizer).vocabulary
        except (ValueError, FileNotFoundError, ImportError) as err:
            raise DataError(f"{self.prefix}: its tokenizer {tokenizer!r} cannot be loaded: {err}") from err
        self.plain, self.v1_shape, self.image_count = True, None, 0
        self.tokens = _open_indexed(self.prefix, None, None)
        self.num_documents = len(self.tokens.index.document_indices) - 1

    def __len__(self) -> int:
        return self.num_documents

    @cached_property
    def images_per_document(self) -> np.ndarray:
        if self.images is None:
            return np.zeros(self.num_documents, dtype=np.int64)
        return np.diff(self.images.index.document_indices).astype(np.int64)

    @cached_property
    def _first_sequence(self) -> np.ndarray:
        """Each document's first sequence (Megatron's tools may write several per document)."""
        return self.tokens.index.document_indices.astype(np.int64)

    @cached_property
    def first_image(self) -> np.ndarray:
        """[documents + 1]: the index of each document's first image (and the image count at the end)."""
        if self.images is None:
            return np.zeros(self.num_documents + 1, dtype=np.int64)
        return self.images.index.document_indices.astype(np.int64)

    def document_lengths(self, tokens_per_image: np.ndarray) -> np.ndarray:
        """Tokens of every document once read: body, BOS and EOS, and tokens_per_image[i] for image i."""
        sequences = self.tokens.index.sequence_lengths.astype(np.int64)
        body = sequences if len(sequences) == self.num_documents else np.add.reduceat(
            sequences, self._first_sequence[:-1]) if len(sequences) else np.zeros(self.num_documents, np.int64)
        image_sums = np.concatenate([[0], np.cumsum(tokens_per_image, dtype=np.int64)])
        return body + 2 + image_sums[self.first_image[1:]] - image_sums[self.first_image[:-1]]

    def _body(self, index: int) -> np.ndarray:
        start, stop = self._first_sequence[index:index + 2]
        if stop - start == 1:
            return self.tokens[int(start)].astype(np.int64)
        return np.concatenate([self.tokens[int(i)] for i in range(start, stop)] or [[]]).astype(np.int64)

    def document(self, index: int, with_images: bool = True) -> Document:
        """Record `index`; without its images' pixels (images empty) when with_images is False."""
        vocab = self.vocabulary
        body = self._body(index)
        limit = vocab.base_size if self.plain else vocab.size  # a plain dataset holds no special ids
        if body.size and body.max() >= limit:
            what = f"the {limit} ids of its tokenizer" if self.plain else f"the vocabulary of {limit}"
            raise DataError(f"{self.prefix}.bin: record {index} holds token id {int(body.max())}, outside "
                            f"{what} ({vocab.kind})")
        images = []
        if self.images is not None and with_images:
            for i in range(*self.first_image[index:index + 2]):
                t, C, H, W = self.image_shapes[i].tolist()
                flat = self.images[int(i)]
                images.append(flat.reshape(C, H, W) if t == 1 else flat.reshape(t, C, H, W))
        markers, indexed = int((body == vocab.image_start).sum()), int(self.images_per_document[index])
        if markers != indexed:
            raise DataError(f"{self.prefix}.bin: record {index} has {markers} image markers but {indexed} images")
        return Document(np.concatenate([[vocab.bos], body, [vocab.eos]]), images)
