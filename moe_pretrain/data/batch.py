"""Training batches: the blended document stream packed into rows, turned into inputs, labels and masks.

Shape legend: B rows, T = seq_len, P patches in the batch. Labels are IGNORE_INDEX where the target is
not text (padding, BOS, image tokens) or belongs to another document than the input.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_pretrain.config import BlendConfig, Config, ConfigError
from moe_pretrain.data.embedded import embedded_blend
from moe_pretrain.data.heldout import held_out
from moe_pretrain.data.indexed import DataError, IndexedDocuments
from moe_pretrain.data.mixture import DocumentMixture, PoolShare, split_pools
from moe_pretrain.data.packing import DocumentRef, PackedRow, RowPlan, SequencePacker, assemble_row
from moe_pretrain.data.patches import expand_image_tokens, expand_images, patches_per_image
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
    """[B, T] bool, True at image patch inputs."""
    patches: torch.Tensor
    """[P, patch_dim] float32, one per True in image_mask, in row-major order; [0, patch_dim] on a rank
    that does not embed images (a pipeline's later stages), which never reads their pixels."""

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
        rows[torch.arange(rows.shape[1], device=counts.device) < counts.unsqueeze(1)] = self.patches
        return rows

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.labels, self.doc_ids, self.image_mask,
                                                self.patches)))


def rows_to_batch(rows: list[PackedRow], patch_dim: int, vocab: Vocabulary, with_patches: bool = True) -> Batch:
    tokens = np.stack([r.tokens for r in rows])
    doc_ids = np.stack([r.doc_ids for r in rows])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    text_target = ~np.isin(targets, vocab.non_text)
    same_doc = doc_ids[:, 1:] == doc_ids[:, :-1]
    labels = np.where(text_target & same_doc, targets, IGNORE_INDEX)
    image_mask = inputs == vocab.image_patch
    patches = []
    for row, mask in zip(rows, image_mask) if with_patches else ():
        patches.extend(row.patches[: int(mask.sum())])  # a patch at the row's last position is label-only
    patch_array = np.stack(patches).astype(np.float32) if patches else np.zeros((0, patch_dim), np.float32)
    return Batch(
        torch.from_numpy(inputs.copy()), torch.from_numpy(labels), torch.from_numpy(doc_ids[:, :-1].copy()),
        torch.from_numpy(image_mask), torch.from_numpy(patch_array),
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
        self.patch_size, self.patch_dim = cfg.model.vision.patch_size, cfg.model.vision.patch_dim
        self.datasets: dict[str, IndexedDocuments] = {}
        self.lengths: dict[str, np.ndarray] = {}
        """Dataset path -> every document's length in tokens, images expanded: all the packer reads."""
        self.names: dict[str, str] = {}
        """Dataset path -> the name positions are saved under (cached corpora: their file name)."""
        self.held_out: dict[str, np.ndarray] = {}
        """Dataset path -> records held out of training for validation (eval.holdout)."""
        self._embedded: list[BlendConfig] | None = None
        self.plans = self._plans()
        self.mixtures = [self._mixture(plan) for plan in self.plans]
        self._max_patches = self._patch_row_widths()  # per stage, computed once: the pipeline asks every step
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
            self.lengths[path] = dataset.document_lengths(self._patches_per_image(dataset))
        return self.datasets[path]

    def _check_images(self, dataset: IndexedDocuments) -> None:
        vision = self.cfg.model.vision
        if dataset.image_shape is None:
            return
        C, H, W = dataset.image_shape
        if C != vision.channels or H % vision.patch_size or W % vision.patch_size:
            raise ConfigError(f"{dataset.prefix} holds {C}x{H}x{W} images, which model.vision (channels="
                              f"{vision.channels}, patch_size={vision.patch_size}) cannot cut into patches")

    def _blend(self, plan: MixturePlan) -> tuple[list[BlendConfig], bool]:
        if plan.blend:
            return plan.blend, False
        if self._embedded is None:
            self._embedded = embedded_blend(self.cfg.data, self.cfg.model.vision.channels)
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
            shares += split_pools(name, dataset, lengths, entry.weight, plan.long_share, long_tokens,
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

    def _patches_per_image(self, dataset: IndexedDocuments) -> int:
        return patches_per_image(dataset.image_shape, self.patch_size) if dataset.image_shape else 0

    def reference(self, prefix: str, record: int, offset: int = 0) -> DocumentRef:
        dataset = self.datasets[prefix]
        return DocumentRef((prefix, record), int(self.lengths[prefix][record]) - offset,
                           bool(dataset.images_per_document[record]), offset)

    def read_document(self, origin: tuple[str, int], with_patches: bool = True) -> tuple[np.ndarray,
                                                                                       np.ndarray | None]:
        """A whole document's tokens (images expanded) and its patches (None for text, or without patches:
        then its pixels are not even read)."""
        prefix, record = origin
        dataset = self.datasets[prefix]
        raw = dataset.document(record, with_images=with_patches)
        if with_patches:
            tokens, patches = expand_images(raw.tokens, raw.images, self.vocabulary, self.patch_size)
        else:
            count = int(dataset.images_per_document[record])
            tokens = expand_image_tokens(raw.tokens, [self._patches_per_image(dataset)] * count, self.vocabulary)
            patches = None
        if len(tokens) != self.lengths[prefix][record]:
            raise DataError(f"{prefix}: record {record} reads as {len(tokens)} tokens, its index says "
                            f"{int(self.lengths[prefix][record])}")
        return tokens, patches

    def _next_document(self) -> DocumentRef:
        mixture = self.mixtures[self.mixture_index]
        pool = mixture.pick()
        k = self.drawn.get(pool.key, 0)
        self.drawn[pool.key] = k + 1
        doc = self.reference(pool.dataset.prefix, pool.document_id(k))
        mixture.record(pool, doc.length)
        return doc

    def max_patches_per_row(self, index: int) -> int:
        """Most patch tokens a row of stage `index` can hold (each image brings its patches and two markers):
        the fixed width of the per-row patch padding a pipeline's first stage receives."""
        return self._max_patches[index]

    def _patch_row_widths(self) -> list[int]:
        widths = []
        for plan, mixture in zip(self.plans, self.mixtures):
            most = 0
            for share in mixture.shares:
                shape = share.pool.dataset.image_shape
                if shape:
                    per_image = patches_per_image(shape, self.patch_size)
                    most = max(most, min((plan.seq_len + 1) // (per_image + 2) * per_image, plan.seq_len))
            widths.append(most)
        return widths

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
