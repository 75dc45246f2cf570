"""Which fragments of the sequence MLA's latent exchange brings each context-parallel rank: those its queries can
see, not every one.

Shape legend: B rows of T positions, each cut into 2 cp fragments of F = T / (2 cp) positions; global fragment
g = row x 2 cp + j; C latent width.

Attention stays inside a document and looks only back (ops/latent_attention.py), so a rank's fragment j sees
the fragments from the one holding its first position's document start up to j itself, and no others. Where
documents are short, that is the fragment itself and perhaps the one or two before it; where one document
fills the row, it is every fragment up to j. Rank r (fragments r and 2 cp - 1 - r) receives the union of what
its two fragments of each row see, in sequence order, from their owners, in one all-to-all whose splits every
rank works out alike from the documents' bounds (host integers, the same on every rank: nothing is told).
It sends its own fragments to each rank that sees them and keeps its own without a collective.

The keys it attends over are then a compact sequence: the fragments received, in sequence order, with their
documents' bounds mapped onto it and a bound at every gap (no query sees across a gap: a document that reached
over it would make the fragments between visible too). With one document per row this is the all-gather less
the future (rank r receives 2 cp - r - 2 fragments from the others, sends its front fragment to cp - 1 ranks
and its back one to r), and with the short documents of the embedded corpus it is a few fragments a rank.
"""

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class LatentRoute:
    """One rank's share of the exchange, for one micro-batch's documents."""

    needed: tuple[int, ...]
    """The global fragments this rank's queries see, ascending: the compact key sequence, F keys each."""
    send_slots: tuple[int, ...]
    """Local fragments (row x 2 + slot) sent, grouped by destination rank in rank order, each destination's in
    its sequence order."""
    input_splits: list[int]
    output_splits: list[int]
    order: tuple[int, ...]
    """For each needed fragment, its row in [the local fragments (B x 2), then the received ones]."""
    query_index: list[int]
    """Each local position's place in the compact key sequence."""
    bounds: list[int]
    """The compact key sequence's document bounds (cu_seqlens, 0 ... len(needed) x F)."""

    @staticmethod
    def of(bounds: list[int], rows: int, seq_len: int, cp: int, rank: int) -> "LatentRoute":
        """The route of cp rank `rank` over rows whose flattened documents start at `bounds` (cu_seqlens)."""
        return _route(rank, _seen(bounds, rows, seq_len, cp), bounds, rows, seq_len, cp)

    @staticmethod
    def every(bounds: list[int], rows: int, seq_len: int, cp: int) -> list["LatentRoute"]:
        """Every cp rank's route (the plan's), what each rank sees worked out once for them all."""
        seen = _seen(bounds, rows, seq_len, cp)
        return [_route(rank, seen, bounds, rows, seq_len, cp) for rank in range(cp)]


def _seen(bounds: list[int], rows: int, seq_len: int, cp: int) -> list[list[int]]:
    """Per cp rank, the global fragments its queries see, ascending: each of its fragments sees back to the one
    holding its first position's document start."""
    n = 2 * cp
    F = seq_len // n
    every = []
    for s in range(cp):
        seen: set[int] = set()
        for row in range(rows):
            for j in (s, n - 1 - s):
                start = bounds[bisect.bisect_right(bounds, row * seq_len + j * F) - 1]
                seen.update(range(row * n + (start - row * seq_len) // F, row * n + j + 1))
        every.append(sorted(seen))
    return every


def _route(rank: int, seen: list[list[int]], bounds: list[int], rows: int, seq_len: int, cp: int) -> LatentRoute:
    """cp rank `rank`'s route, from what every rank sees (_seen): what it receives, and what it sends to whom."""
    n = 2 * cp
    F = seq_len // n

    def owner(g: int) -> tuple[int, int]:
        """(rank, local fragment) holding global fragment g."""
        row, j = divmod(g, n)
        return min(j, n - 1 - j), row * 2 + (j >= cp)

    needed = seen[rank]
    send_slots, input_splits = [], [0] * cp
    for s in range(cp):
        if s != rank:
            mine = [owner(g)[1] for g in seen[s] if owner(g)[0] == rank]
            send_slots += mine
            input_splits[s] = len(mine)
    by_source: list[list[int]] = [[] for _ in range(cp)]
    for g in needed:
        source, _ = owner(g)
        if source != rank:
            by_source[source].append(g)
    received = [g for source in by_source for g in source]
    arrival = {g: rows * 2 + i for i, g in enumerate(received)}
    order = tuple(owner(g)[1] if owner(g)[0] == rank else arrival[g] for g in needed)
    place = {g: i * F for i, g in enumerate(needed)}
    query_index = [place[row * n + j] + t for row in range(rows) for j in (rank, n - 1 - rank) for t in range(F)]
    return LatentRoute(tuple(needed), tuple(send_slots), input_splits, [len(s) for s in by_source], order,
                       query_index, _compact_bounds(bounds, needed, F))


def _compact_bounds(bounds: list[int], needed: list[int], F: int) -> list[int]:
    """Document bounds over the needed fragments laid end to end: each global bound inside a fragment, and a
    bound wherever a fragment does not continue the one before it in the sequence."""
    compact = []
    for i, g in enumerate(needed):
        start = g * F  # rows are whole multiples of fragments, so g x F is the fragment's flat position
        if i == 0 or needed[i - 1] != g - 1:
            compact.append(i * F)
        for b in bounds[bisect.bisect_left(bounds, start):bisect.bisect_left(bounds, start + F)]:
            if i * F + b - start != compact[-1]:
                compact.append(i * F + b - start)
    return [*compact, len(needed) * F]
