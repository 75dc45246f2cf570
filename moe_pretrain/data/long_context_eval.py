"""Long-context evaluation rows: long held-out documents from their first token (for the loss by position),
and a pass-key retrieval probe (a key planted at a depth of filler text, asked for at the end).

Every row starts at a document's first token, so a token's position in the row is its position in the
document: the loss of the positions in [lo, hi) tells whether later positions gain from the context. The
probe's rows are built from text through the data's tokenizer; only the key's token at the end is scored
(next-token top-1), so a sample is right or wrong whatever the layout splits.
"""

import numpy as np
import torch

from moe_pretrain.data.batch import IGNORE_INDEX, Batch, PretrainingData
from moe_pretrain.data.packing import RowPlan, Segment
from moe_pretrain.data.tokenizers import load_tokenizer
from moe_pretrain.data.validation import ValidationSet
from moe_pretrain.data.vocabulary import Vocabulary

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEPTHS = (0.1, 0.5, 0.9)
KEYS = "0123456789"


def position_edges(seq_len: int, base: int) -> list[int]:
    """Bucket edges 0, b, 4b, 16b, ..., seq_len, with b = base, or seq_len / 16 for short stages."""
    step = max(min(base, seq_len // 16), 1)
    edges = [0]
    while step < seq_len:
        edges.append(step)
        step *= 4
    return [*edges, seq_len]


def long_document_rows(data: PretrainingData, sets: list[ValidationSet], seq_len: int, count: int) -> list[RowPlan]:
    """Rows of the `count` longest validation documents, each from its first token (ties: dataset, record)."""
    candidates = []
    for validation in sets:  # each set's longest first (numpy), then the merge: cheap for any held-out size
        lengths = data.lengths[validation.path][validation.records]
        longest = np.argsort(-lengths, kind="stable")[:count]
        candidates += [(-int(lengths[i]), validation.path, int(validation.records[i])) for i in longest]
    candidates.sort()
    rows = []
    for negative, path, record in candidates[:count]:
        taken = min(-negative, seq_len + 1)
        image = bool(data.datasets[path].images_per_document[record])
        rows.append(RowPlan([Segment((path, record), 0, taken, image)], seq_len + 1 - taken))
    return rows


def keep_positions(batch: Batch, lo: int, hi: int) -> Batch:
    """The batch with labels only at input positions [lo, hi)."""
    labels = batch.labels.clone()
    positions = torch.arange(labels.shape[1])
    labels[:, (positions < lo) | (positions >= hi)] = IGNORE_INDEX
    return Batch(batch.tokens, labels, batch.doc_ids, batch.image_mask, batch.patches, batch.grids, batch.starts)


def probe_tokenizer(vocab: Vocabulary):
    """The encode function of the data's tokenizer (byte, or the file the data names), or None if absent."""
    spec = "byte" if vocab.kind == "byte" else f"{vocab.kind}:{vocab.source}"
    try:
        return load_tokenizer(spec).encode
    except (FileNotFoundError, ImportError, ValueError):
        return None


def probe_row(encode, vocab: Vocabulary, length: int, depth: float, key: str, row_len: int) -> tuple[np.ndarray, int]:
    """(row of row_len tokens: BOS, filler with the key planted at `depth`, the question, padding; index of
    the key's token at the end)."""
    needle = encode(f" The pass key is {key}. Remember it. ")
    question = encode(f" What is the pass key? The pass key is {key}")
    budget = max(length - 1 - len(needle) - len(question), 0)
    filler_unit = encode(FILLER)
    filler = (filler_unit * (budget // max(len(filler_unit), 1) + 1))[:budget]
    at = int(depth * budget)
    body = [vocab.bos, *filler[:at], *needle, *filler[at:], *question]
    row = np.full(row_len, vocab.pad, dtype=np.int64)
    row[:len(body)] = body[:row_len]
    return row, min(len(body), row_len) - 1


def probe_batches(vocab: Vocabulary, encode, seq_len: int, samples: int, rows: int, seed: int, shard: int,
                  num_shards: int, patch_dim: int) -> dict[str, Batch]:
    """This rank's probe rows per (length, depth) cell, `rows` per cell (samples, then unscored padding); cells are
    named <context tokens>@<depth>: 64@0.5, ..., 256@0.9 on a 256-token stage."""
    out = {}
    per_shard = rows // num_shards
    for length in sorted({(seq_len + 1) // 4, (seq_len + 1) // 2, seq_len + 1}):
        for depth in DEPTHS:
            rng = np.random.default_rng([seed, length, int(depth * 100)])
            tokens = np.full((rows, seq_len + 1), vocab.pad, dtype=np.int64)
            labels = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
            doc_ids = np.ones((rows, seq_len), dtype=np.int64)
            for sample in range(samples):
                row, answer = probe_row(encode, vocab, length, depth, KEYS[rng.integers(len(KEYS))], seq_len + 1)
                tokens[sample] = row
                labels[sample, answer - 1] = row[answer]
                doc_ids[sample, :answer] = 0
            mine = slice(shard * per_shard, (shard + 1) * per_shard)
            # Named by the tokens the model reads: a row of length + 1 tokens is length inputs and their targets.
            out[f"{min(length, seq_len)}@{depth}"] = Batch(
                torch.from_numpy(tokens[mine, :-1].copy()), torch.from_numpy(labels[mine].copy()),
                torch.from_numpy(doc_ids[mine].copy()), torch.zeros(per_shard, seq_len, dtype=torch.bool),
                torch.zeros(0, patch_dim), [[] for _ in range(per_shard)], [[] for _ in range(per_shard)])
    return out
