"""The deal of images over a tensor x context block and the token exchange's routes (parallel/image_split.py),
checked by playing every rank's all-to-alls on the host: each rank must end with the tokens of exactly its own
positions, in their order, whatever the layout. The distributed run itself is checked against one process in
tests/distributed/test_parallel_training.py (its images-* layouts)."""

import numpy as np
import pytest
import torch

from moe_pretrain.data.patches import PlacedImage
from parallel.context_parallel import ContextParallel, NoContextParallel
from parallel.image_split import ImageSplit, deal
from parallel.sequence import NoSequenceParallel, SequenceParallel


class Rank:
    """A context- or sequence-parallel split at a given size and rank, without a process group."""

    def __init__(self, cls, size: int, rank: int):
        self.split = cls.__new__(cls)
        self.split.size, self.split.rank = size, rank
        if cls is ContextParallel:
            self.split.fragments = (rank, 2 * size - 1 - rank)


def split_of(cp: int, tp: int, c: int, s: int) -> ImageSplit:
    context = Rank(ContextParallel, cp, c).split if cp > 1 else NoContextParallel()
    sequence = Rank(SequenceParallel, tp, s).split if tp > 1 else NoSequenceParallel()
    return ImageSplit(context, sequence)


def held_positions(cp: int, tp: int, c: int, s: int, rows: int, T: int) -> list[tuple[int, int]]:
    """(row, position) of rank (c, s)'s positions in its local row-major order (ContextParallel.local, then
    the sequence shard)."""
    F = T // (2 * cp)
    local = [j * F + t for j in ((c, 2 * cp - 1 - c) if cp > 1 else (0,)) for t in range(F if cp > 1 else T)]
    chunk = len(local) // tp
    return [(row, p) for row in range(rows) for p in local[s * chunk:(s + 1) * chunk]]


def play(routes: dict, held: dict, sources: list[tuple[int, int]], me: int, group: str) -> list[int]:
    """What rank `me` of a group receives in its all-to-all: each source's rows in its send order, the
    part the source's split sizes give `me`, sources in rank order."""
    pieces = []
    for source in sources:
        route = routes[source]
        order, send = getattr(route, f"{group}_order"), getattr(route, f"{group}_send")
        sent = [held[source][i] for i in order]
        pieces += sent[sum(send[:me]):sum(send[:me + 1])]
    return pieces


IMAGES = [PlacedImage(0, 1, (1, 4, 6)), PlacedImage(0, 9, (2, 2, 2)), PlacedImage(0, 11, (1, 6, 4)),
          PlacedImage(1, 3, (1, 8, 8)), PlacedImage(1, 20, (1, 2, 2)), PlacedImage(2, 27, (1, 4, 4))]


@pytest.mark.parametrize(("cp", "tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_every_rank_receives_exactly_its_positions_tokens(cp, tp):
    rows, T, merge = 3, 32, 2
    # Token k of the micro-batch (row-major) carries its (row, position) as its value.
    where = [(image.row, image.start + i) for image in IMAGES for i in range(image.tokens(merge))]
    ranks = [(c, s) for c in range(cp) for s in range(tp)]
    splits = {rank: split_of(cp, tp, *rank) for rank in ranks}
    routes = {rank: splits[rank].route(IMAGES, merge, T) for rank in ranks}
    # Every image is encoded exactly once in the block.
    assert sorted(i for route in routes.values() for i in route.encoded) == list(range(len(IMAGES)))
    first = np.cumsum([0] + [image.tokens(merge) for image in IMAGES])
    encoded = {rank: [k for i in routes[rank].encoded for k in range(first[i], first[i + 1])] for rank in ranks}
    # Play the cp all-to-all (among ranks of one tensor rank), then the tp one (among ranks of one cp rank).
    after_cp = {(c, s): play(routes, encoded, [(source, s) for source in range(cp)], c, "cp") if cp > 1
                else encoded[c, s] for c, s in ranks}
    for c, s in ranks:  # what each rank expects from each source is what that source sends it
        assert routes[c, s].cp_receive == [routes[source, s].cp_send[c] for source in range(cp)]
        assert routes[c, s].tp_receive == [routes[c, source].tp_send[s] for source in range(tp)]
    final = {}
    for c, s in ranks:
        received = play(routes, after_cp, [(c, source) for source in range(tp)], s, "tp") if tp > 1 else after_cp[c, s]
        order = routes[c, s].local_order  # None: as received (a block of one rank)
        final[c, s] = received if order is None else [received[i] for i in order]
    for c, s in ranks:
        mine = set(held_positions(cp, tp, c, s, rows, T))
        expected = [pos for pos in held_positions(cp, tp, c, s, rows, T) if pos in set(where)]
        assert [where[k] for k in final[c, s]] == expected and set(expected) <= mine, (c, s)


def test_the_deal_balances_patches_and_is_the_same_everywhere():
    sizes = [100, 10, 60, 50, 40, 30]
    owner = deal(sizes, 3)
    assert owner.tolist() == [0, 1, 1, 2, 2, 1]  # 100 | 60 + 30 + 10 | 50 + 40
    assert np.array_equal(owner, deal(sizes, 3))
    split = split_of(1, 1, 0, 0)
    route = split.route(IMAGES, 2, 32)
    assert route.encoded == list(range(len(IMAGES)))  # one rank: every image, in order, no reordering
    x = torch.arange(10.0).unsqueeze(1)
    assert split.exchange(x, route) is x
