"""Training batches: the blended document stream packed into rows, turned into inputs, labels and masks.

Shape legend: B rows, T = seq_len, P patches in the batch (every image's t x h x w grid of them), N image
tokens (each image's (h/m)(w/m) merged blocks). Labels are IGNORE_INDEX where the target is not text (padding,
BOS, image tokens) or belongs to another document than the input.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_pretrain.config import BlendConfig, Config, ConfigError
from moe_pretrain.data.embedded import embedded_blend
from moe_pretrain.data.heldout import held_out
from moe_pretrain.data.image_size import fitted_size, resize, run_max_pixels
from moe_pretrain.data.indexed import DataError, IndexedDocuments
from moe_pretrain.data.mixture import DocumentMixture, PoolShare, split_pools
from moe_pretrain.data.packing import DocumentRef, PackedRow, RowPlan, SequencePacker, assemble_row
from moe_pretrain.data.patches import Grid, expand_image_tokens, expand_images, image_tokens
from moe_pretrain.data.vocabulary import Vocabulary

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
    """[B, T] bool, True at image token inputs (N of them)."""
    patches: torch.Tensor
    """[P, patch_dim] float32, every image's patches in row-major order of the images; [0, patch_dim] on a
    rank that does not embed images (a pipeline's later stages), which never reads their pixels."""
    grids: list[list[Grid]]
    """Per row, the (t, h, w) patch grid of each of its images, in order: host integers, known from the
    index without pixels (the vision tower loops over images with them; reading them syncs nothing)."""
    starts: list[list[int]]
    """Per row, the position of each image's first token (host integers, like grids)."""

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def image_grids(self) -> list[Grid]:
        """Every image's grid, in row-major order."""
        return [grid for row in self.grids for grid in row]

    def patches_per_row(self) -> list[int]:
        return [sum(t * h * w for t, h, w in row) for row in self.grids]

    @staticmethod
    def concatenate(batches: list["Batch"]) -> "Batch":
        """Rows of several batches, in order (patches stay in row-major order)."""
        return Batch(*(torch.cat([getattr(b, f) for b in batches]) for f in
                       ("tokens", "labels", "doc_ids", "image_mask", "patches")),
                     [row for b in batches for row in b.grids], [row for b in batches for row in b.starts])

    def rows(self, start: int, count: int) -> "Batch":
        """Rows [start, start + count), with their patches (none where this rank reads no pixels)."""
        per_row = self.patches_per_row() if self.patches.shape[0] else [0] * len(self.grids)
        first = sum(per_row[:start])
        patches = self.patches[first:first + sum(per_row[start:start + count])]
        return Batch(*(getattr(self, f)[start:start + count] for f in ("tokens", "labels", "doc_ids", "image_mask")),
                     patches, self.grids[start:start + count], self.starts[start:start + count])

    def split(self, parts: int) -> list["Batch"]:
        """`parts` equal runs of rows (as a pipeline's library splits its inputs into micro-batches)."""
        count = self.tokens.shape[0] // parts
        return [self.rows(part * count, count) for part in range(parts)]

    def to(self, device: torch.device | str) -> "Batch":
        """The token tensors on `device`; the patches stay where the loader made them (host memory): a rank
        moves only the images it encodes, a micro-batch at a time (MoETransformer.encode_images), where the
        step's whole batch of patches, up to about four a position on a first pipeline stage, would not fit
        beside the model at long context."""
        return Batch(*(t.to(device) for t in (self.tokens, self.labels, self.doc_ids, self.image_mask)),
                     self.patches, self.grids, self.starts)


def rows_to_batch(rows: list[PackedRow], patch_dim: int, vocab: Vocabulary, with_patches: bool = True) -> Batch:
    tokens = np.stack([r.tokens for r in rows])
    doc_ids = np.stack([r.doc_ids for r in rows])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    text_target = ~np.isin(targets, vocab.non_text)
    same_doc = doc_ids[:, 1:] == doc_ids[:, :-1]
    labels = np.where(text_target & same_doc, targets, IGNORE_INDEX)
    image_mask = inputs == vocab.image_patch
    patches = [p for row in rows for p in row.patches] if with_patches else []
    patch_array = np.concatenate(patches).astype(np.float32) if patches else np.zeros((0, patch_dim), np.float32)
    # An image's tokens follow its IMAGE_START (documents with images are never cut, and end in EOS).
    starts = [(np.flatnonzero(row_inputs == vocab.image_start) + 1).tolist() for row_inputs in inputs]
    return Batch(
        torch.from_numpy(inputs.copy()), torch.from_numpy(labels), torch.from_numpy(doc_ids[:, :-1].copy()),
        torch.from_numpy(image_mask), torch.from_numpy(patch_array), [row.grids for row in rows], starts,
    )


@dataclass
class MixturePlan:
    """What one stage (or the whole run, without stages) draws its documents from."""

    where: str
    """The config key errors name: "data" or "stages[i]"."""
    seq_len: int
    blend: list[BlendConfig]
    long_share: float | None
    long_tokens: int


class PretrainingData:
    """The data pipeline: blended datasets -> packer -> batches, with a global, layout-independent position.

    Every mixture a run will use (one per stage) is opened and checked at start, so a dataset that cannot
    serve a later stage fails now rather than weeks in.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        vision = cfg.model.vision
        self.patch_size, self.patch_dim, self.merge = vision.patch_size, vision.patch_dim, vision.encoder.merge
        self.max_pixels = run_max_pixels(cfg)
        """Every image is trained at most this large (data.max_image_pixels, or its default)."""
        self.datasets: dict[str, IndexedDocuments] = {}
        self.grids: dict[str, np.ndarray] = {}
        """Dataset path -> every image's (t, h, w) patch grid at the size it is trained at."""
        self.lengths: dict[str, np.ndarray] = {}
        """Dataset path -> every document's length in tokens, images expanded: all the packer reads."""
        self.names: dict[str, str] = {}
        """Dataset path -> the name positions are saved under (cached corpora: their file name)."""
        self.held_out: dict[str, np.ndarray] = {}
        """Dataset path -> records held out of training for validation (eval.holdout)."""
        self._embedded: list[BlendConfig] | None = None
        self.plans = self._plans()
        self.mixtures = [self._mixture(plan) for plan in self.plans]
        self.drawn: dict[str, int] = {}
        """Documents drawn so far from each pool (by pool key): with the mixture counters, the position."""
        self.mixture_index = 0
        self.rows = 0
        self.packer = SequencePacker(self._next_document, self.plans[0].seq_len)

    def _plans(self) -> list[MixturePlan]:
        data = self.cfg.data
        if not self.cfg.stages:
            return [MixturePlan("data", data.seq_len, data.blend, data.long_doc_share, data.long_doc_tokens)]
        return [MixturePlan(f"stages[{i}]", s.seq_len, s.blend or data.blend,
                            data.long_doc_share if s.long_doc_share is None else s.long_doc_share,
                            s.long_doc_tokens or data.long_doc_tokens) for i, s in enumerate(self.cfg.stages)]

    def open_dataset(self, path: str, tokenizer: str = "") -> IndexedDocuments:
        """The dataset at `path` (opened once); tokenizer: for a plain Megatron one, else data.tokenizer."""
        if path not in self.datasets:
            dataset = IndexedDocuments(path, tokenizer or self.cfg.data.tokenizer)
            first = next(iter(self.datasets.values()), None)
            if first is not None and not first.vocabulary.same_ids(dataset.vocabulary):
                raise ConfigError(f"{path} was tokenized with {dataset.vocabulary.kind} ({dataset.vocabulary.size} "
                                  f"ids), {first.prefix} with {first.vocabulary.kind} ({first.vocabulary.size}): a "
                                  "blend must share one tokenizer")
            self._check_images(dataset)
            self.datasets[path] = dataset
            self.grids[path] = self._fitted_grids(dataset)
            tokens = (self.grids[path][:, 1] // self.merge) * (self.grids[path][:, 2] // self.merge)
            self.lengths[path] = dataset.document_lengths(tokens)
        return self.datasets[path]

    def _check_images(self, dataset: IndexedDocuments) -> None:
        vision = self.cfg.model.vision
        if dataset.channels is None:
            return
        if dataset.channels != vision.channels:
            raise ConfigError(f"{dataset.prefix} holds images of {dataset.channels} channels, model.vision.channels="
                              f"{vision.channels}")
        frames = dataset.image_shapes[:, 0]
        if frames.max() > vision.encoder.max_frames:
            image = int(np.argmax(frames))
            record = int(np.searchsorted(dataset.first_image, image, side="right")) - 1
            raise ConfigError(f"{dataset.prefix} record {record} holds a clip of {int(frames.max())} frames, more "
                              f"than model.vision.encoder.max_frames={vision.encoder.max_frames}")

    def _fitted_grids(self, dataset: IndexedDocuments) -> np.ndarray:
        """[images, 3] (t, h, w): each image's patch grid once fitted to self.max_pixels (image_size.py)."""
        shapes = dataset.image_shapes
        if not len(shapes):
            return np.zeros((0, 3), dtype=np.int64)
        sizes, inverse = np.unique(shapes[:, 2:], axis=0, return_inverse=True)
        unit = self.patch_size * self.merge
        fitted = np.array([fitted_size(H, W, self.max_pixels, unit) for H, W in sizes.tolist()], dtype=np.int64)
        return np.column_stack([shapes[:, 0], fitted[inverse.reshape(-1)] // self.patch_size])

    def _blend(self, plan: MixturePlan) -> tuple[list[BlendConfig], bool]:
        if plan.blend:
            return plan.blend, False
        if self._embedded is None:  # with long documents of each stage's length that draws from long ones
            long_lengths = tuple(sorted({p.seq_len for p in self.plans if not p.blend and p.long_share}))
            self._embedded = embedded_blend(self.cfg.data, self.cfg.model.vision.channels, long_lengths)
        return self._embedded, True

    def _mixture(self, plan: MixturePlan) -> DocumentMixture:
        blend, embedded = self._blend(plan)
        long_tokens = plan.long_tokens or max(plan.seq_len // 2, 1)
        shares: list[PoolShare] = []
        for entry in blend:
            dataset = self.open_dataset(entry.path, entry.tokenizer)
            lengths = self.lengths[entry.path]
            with_images = np.flatnonzero(dataset.images_per_document > 0)
            if with_images.size and lengths[with_images].max() > plan.seq_len + 1:
                record = int(with_images[np.argmax(lengths[with_images])])
                raise ConfigError(f"{plan.where}.seq_len={plan.seq_len}: {entry.path} record {record} takes "
                                  f"{int(lengths[record])} tokens with its images, more than a row of seq_len + 1; "
                                  "documents with images are never cut")
            # Cached corpora are named by content, so their pools keep their position if the cache moves.
            name = Path(entry.path).name if embedded else entry.path
            self.names[entry.path] = name
            # The embedded images are short documents: a long share draws from the embedded text.
            long_share = None if embedded and with_images.size else plan.long_share
            shares += split_pools(name, dataset, lengths, entry.weight, long_share, long_tokens,
                                  self.cfg.data.seed, plan.where, self._trainable(entry.path, name, len(dataset)))
        return DocumentMixture(shares)

    def _trainable(self, path: str, name: str, documents: int) -> np.ndarray | None:
        """The records training may draw: all (None), or all but those validation holds out (eval.holdout,
        when eval is on without an eval.blend); the held-out ones are kept in self.held_out."""
        evaluation = self.cfg.eval
        if not evaluation.enabled or evaluation.blend:
            return None
        if path not in self.held_out:
            mask = held_out(name, documents, evaluation.holdout, self.cfg.data.seed)
            if mask.all() or not mask.any():
                raise ConfigError(f"eval.holdout={evaluation.holdout} holds out {int(mask.sum())} of the {documents} "
                                  f"documents of {path}; validation needs some, training the rest")
            self.held_out[path] = np.flatnonzero(mask)
        return np.setdiff1d(np.arange(documents), self.held_out[path])

    @property
    def vocabulary(self) -> Vocabulary:
        return next(iter(self.datasets.values())).vocabulary

    def reference(self, prefix: str, record: int, offset: int = 0) -> DocumentRef:
        dataset = self.datasets[prefix]
        return DocumentRef((prefix, record), int(self.lengths[prefix][record]) - offset,
                           bool(dataset.images_per_document[record]), offset)

    def read_document(self, origin: tuple[str, int], with_patches: bool = True
                      ) -> tuple[np.ndarray, np.ndarray | None, list[Grid]]:
        """A whole document's tokens (images expanded), its patches (None for text, or without patches: then
        its pixels are not even read) and its images' grids."""
        prefix, record = origin
        dataset = self.datasets[prefix]
        raw = dataset.document(record, with_images=with_patches)
        grids = [tuple(g) for g in self.grids[prefix][slice(*dataset.first_image[record:record + 2])].tolist()]
        if with_patches:
            images = [resize(image, h * self.patch_size, w * self.patch_size)
                      for image, (_, h, w) in zip(raw.images, grids)]
            tokens, patches, _ = expand_images(raw.tokens, images, self.vocabulary, self.patch_size, self.merge)
        else:
            tokens = expand_image_tokens(raw.tokens, [image_tokens(g, self.merge) for g in grids], self.vocabulary)
            patches = None
        if len(tokens) != self.lengths[prefix][record]:
            raise DataError(f"{prefix}: record {record} reads as {len(tokens)} tokens, its index says "
                            f"{int(self.lengths[prefix][record])}")
        return tokens, patches, grids

    def _next_document(self) -> DocumentRef:
        mixture = self.mixtures[self.mixture_index]
        pool = mixture.pick()
        k = self.drawn.get(pool.key, 0)
        self.drawn[pool.key] = k + 1
        doc = self.reference(pool.dataset.prefix, pool.document_id(k))
        mixture.record(pool, doc.length)
        return doc

    def set_stage(self, index: int) -> None:
        """Draw from stage `index`'s mixture and pack at its sequence length; documents continue."""
        self.mixture_index = index
        self.packer.row_len = self.plans[index].seq_len + 1

    def next_batch(self, rows: int, shard: int = 0, num_shards: int = 1, with_patches: bool = True) -> Batch:
        """The next `rows` rows of the global stream, or data-parallel shard `shard` of them.

        Every rank plans the same global rows (from document lengths only) and reads, packs and cuts
        images into patches for its contiguous slice alone, so the global batch, and with it the
        training, is the same for any data-parallel size. with_patches=False: no pixels are read.
        """
        if rows % num_shards:
            raise ValueError(f"{rows} rows cannot be split into {num_shards} data-parallel shards")
        plans = [self.packer.next_row() for _ in range(rows)]
        self.rows += rows
        per_shard = rows // num_shards
        return self.read_rows(plans[shard * per_shard:(shard + 1) * per_shard], with_patches)

    def read_rows(self, plans: list[RowPlan], with_patches: bool = True) -> Batch:
        """The batch of these planned rows: their documents read, packed and (with_patches) cut into patches."""
        vocab = self.vocabulary

        def read(origin: tuple[str, int]) -> tuple[np.ndarray, np.ndarray | None]:
            return self.read_document(origin, with_patches)

        return rows_to_batch([assemble_row(plan, read, vocab.pad) for plan in plans], self.patch_dim, vocab,
                             with_patches)

    def state(self) -> dict:
        """The stream's position (JSON): counters only, so resuming costs the same at any point of a run."""
        pending = self.packer.pending
        return {"rows": self.rows, "mixture": self.mixture_index, "drawn": dict(self.drawn),
                "mixture_tokens": self.mixtures[self.mixture_index].tokens.tolist(),
                "pending": [self.names[pending.origin[0]], pending.origin[1], pending.offset] if pending else None}

    def load_state(self, state: dict) -> None:
        self.set_stage(state["mixture"])
        self.rows, self.drawn = state["rows"], dict(state["drawn"])
        mixture = self.mixtures[self.mixture_index]
        if len(state["mixture_tokens"]) != len(mixture.tokens):
            raise ConfigError(f"the checkpoint's data position has {len(state['mixture_tokens'])} pools for "
                              f"{self.plans[self.mixture_index].where}, the config {len(mixture.tokens)}: the blend "
                              "changed; resume with the blend the run was started with")
        mixture.tokens[:] = state["mixture_tokens"]
        pending = state["pending"]
        if pending:
            paths = {name: path for path, name in self.names.items()}
            self.packer.pending = self.reference(paths[pending[0]], pending[1], pending[2])
        else:
            self.packer.pending = None
