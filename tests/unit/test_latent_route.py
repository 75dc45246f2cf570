"""parallel/latent_route.py against a brute-force count: every rank receives exactly the fragments holding some key
one of its queries attends to, every sender sends exactly what its receivers expect in their order, and the
compact key sequence keeps every (query, key) pair's visibility."""

import bisect

import pytest
import torch

from moe_pretrain.model.layout import document_starts
from parallel.latent_route import LatentRoute


def random_bounds(rows: int, seq_len: int, longest: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (rows * seq_len,), generator=generator)
    doc_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:rows * seq_len].view(rows, seq_len)
    return document_starts(doc_ids).tolist()


def held(rows: int, seq_len: int, cp: int, rank: int) -> list[int]:
    """Rank `rank`'s positions in the flattened sequence, in local order (fragments rank, 2 cp - 1 - rank)."""
    F = seq_len // (2 * cp)
    return [row * seq_len + j * F + t for row in range(rows) for j in (rank, 2 * cp - 1 - rank) for t in range(F)]


def owner(fragment: int, cp: int) -> int:
    j = fragment % (2 * cp)
    return min(j, 2 * cp - 1 - j)


def document_of(bounds: list[int], position: int) -> int:
    return bisect.bisect_right(bounds, position) - 1


@pytest.mark.parametrize(("rows", "seq_len", "cp", "longest"), [
    (1, 64, 4, 6), (2, 96, 4, 40), (2, 128, 8, 300), (1, 48, 2, 1000), (3, 64, 8, 2)])
def test_each_rank_receives_what_its_queries_see_and_nothing_else(rows, seq_len, cp, longest):
    bounds = random_bounds(rows, seq_len, longest, seed=rows * 1000 + cp + longest)
    F = seq_len // (2 * cp)
    routes = [LatentRoute.of(bounds, rows, seq_len, cp, rank) for rank in range(cp)]
    for rank, route in enumerate(routes):
        queries = held(rows, seq_len, cp, rank)
        seen = {k // F for q in queries for k in range(bounds[document_of(bounds, q)], q + 1)}
        assert route.needed == tuple(sorted(seen)), rank
        # the compact sequence: key i of it is global position keys[i]
        keys = [g * F + t for g in route.needed for t in range(F)]
        assert [keys[i] for i in route.query_index] == queries
        for qi, q in zip(route.query_index, queries, strict=True):
            for ki, k in enumerate(keys[:qi + 1]):
                visible = document_of(bounds, k) == document_of(bounds, q)
                assert (document_of(route.bounds, ki) == document_of(route.bounds, qi)) == visible, (rank, q, k)
        assert sum(route.output_splits) == sum(owner(g, cp) != rank for g in route.needed)
    # what r sends s, in order, is what s expects from r, in order
    for rank, route in enumerate(routes):
        sent = iter(route.send_slots)
        for s in range(cp):
            slots = [next(sent) for _ in range(route.input_splits[s])]
            fragments = [(slot // 2) * 2 * cp + (rank if slot % 2 == 0 else 2 * cp - 1 - rank) for slot in slots]
            expected = [g for g in routes[s].needed if owner(g, cp) == rank]
            assert fragments == (expected if s != rank else []), (rank, s)
            assert routes[s].output_splits[rank] == len(fragments)


def test_one_document_a_row_is_the_gather_less_the_future():
    """Rank r sees fragments 0 .. 2 cp - 1 - r: it receives 2 cp - r - 2 from the others and sends cp - 1 + r."""
    cp, seq_len = 8, 64
    for rank in range(cp):
        route = LatentRoute.of([0, seq_len], 1, seq_len, cp, rank)
        assert route.needed == tuple(range(2 * cp - rank))
        assert sum(route.output_splits) == 2 * cp - rank - 2
        assert sum(route.input_splits) == cp - 1 + rank
        assert route.bounds == [0, (2 * cp - rank) * seq_len // (2 * cp)]
