"""Which document comes next: pools of documents blended to target token shares, position-addressable.

A pool is one dataset's documents (all of them, or only its long or short ones); it visits them in a
fresh seeded permutation every epoch, so its k-th document is a pure function of (seed, pool, k). A
mixture draws from its pools greedily by token share: the next document comes from the pool furthest
below its share of the tokens drawn so far, which holds every pool within one document of its target
with no randomness to replay. The position of the stream is therefore a few counters (documents drawn
per pool, tokens per pool in this mixture) that any layout can resume from in O(1).
"""

import zlib
from dataclasses import dataclass

import numpy as np

from moe_pretrain.config import ConfigError
from moe_pretrain.data.indexed import IndexedDocuments


class DocumentPool:
    def __init__(self, key: str, dataset: IndexedDocuments, ids: np.ndarray, lengths: np.ndarray, seed: int):
        self.key, self.dataset, self.ids, self.lengths = key, dataset, ids, lengths
        self._seed = [seed, zlib.crc32(key.encode())]
        self._epoch, self._order = -1, ids

    def document_id(self, k: int) -> int:
        """The dataset record of this pool's k-th draw (k counts from the start of training)."""
        epoch, i = divmod(k, len(self.ids))
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = self.ids[np.random.default_rng([*self._seed, epoch]).permutation(len(self.ids))]
        return int(self._order[i])


@dataclass
class PoolShare:
    pool: DocumentPool
    weight: float


def split_pools(name: str, dataset: IndexedDocuments, lengths: np.ndarray, weight: float,
                long_share: float | None, long_tokens: int, seed: int, where: str,
                ids: np.ndarray | None = None) -> list[PoolShare]:
    """One pool for the dataset, or a long and a short one holding long_share and the rest of its weight.
    ids: the records training may draw (default all; validation holds some out)."""
    ids = np.arange(len(dataset)) if ids is None else ids
    lengths = lengths[ids]
    if long_share is None:
        return [PoolShare(DocumentPool(f"{name}#all", dataset, ids, lengths, seed), weight)]
    is_long = lengths >= long_tokens
    shares = []
    for kind, chosen, share in (("long", is_long, long_share), ("short", ~is_long, 1.0 - long_share)):
        if share == 0:
            continue
        if not chosen.any():
            raise ConfigError(f"{where}: long_doc_share={long_share} asks for {kind} documents (long: >= {long_tokens} "
                              f"tokens) but {name} has none")
        key = f"{name}#{kind}{long_tokens}"
        shares.append(PoolShare(DocumentPool(key, dataset, ids[chosen], lengths[chosen], seed), weight * share))
    return shares


class DocumentMixture:
    """Greedy token-share blending of pools; `tokens` (per pool, this mixture only) is its whole state."""

    def __init__(self, shares: list[PoolShare]):
        self.shares = shares
        total = sum(s.weight for s in shares)
        self.targets = np.array([s.weight / total for s in shares])
        self.tokens = np.zeros(len(shares), dtype=np.int64)

    def pick(self) -> DocumentPool:
        """The pool most below its token share; ties go to the first."""
        drawn = max(int(self.tokens.sum()), 1)
        index = int(np.argmin(self.tokens / drawn - self.targets))
        return self.shares[index].pool

    def record(self, pool: DocumentPool, tokens: int) -> None:
        self.tokens[next(i for i, s in enumerate(self.shares) if s.pool is pool)] += tokens
