"""The all-to-all dispatcher and global balancing statistics against single-process references."""

import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher
from moe_pretrain.ops import quantile_balance_update
from moe_pretrain.planning.host_reads import HostReads
from parallel.all_to_all_dispatch import AllToAllTokenDispatcher
from parallel.fp8_dispatch import row_bytes
from parallel.node_dispatch import NodeTokenDispatcher
from parallel.node_groups import expert_node_groups
from parallel.statistics import GroupStatistics
from tests.helpers import rel_rms

F64 = torch.float64
FP8_RMS = 0.06
"""FP8 dispatch against float64: e4m3 rounds each value by up to 2^-4 relative (3.6% rms if uniform); measured
0.3-4.1% over the outputs and gradients of the cases below."""
E, K, L = 8, 2, 3


def routing(kind: str, rank: int, tokens: int, experts: int = E, k: int = K):
    gen = torch.Generator().manual_seed(100 + rank)
    if kind == "random":
        idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
                          or [torch.zeros(0, k)])
    elif kind == "empty_experts":  # experts 2..7 never chosen: ranks > 0 receive nothing at ep 4
        idx = torch.stack([torch.randperm(2, generator=gen) for _ in range(tokens)])
    else:  # all_to_one: every copy of every token to expert 5 (slot order kept distinct by using 5 and 4)
        idx = torch.tensor([[5, 4]] * tokens)
    idx = idx.reshape(tokens, k).long()
    x = torch.randn(tokens, L, generator=gen, dtype=F64)
    w = torch.rand(tokens, k, generator=gen, dtype=F64)
    return x, idx, w


def expert_fn(rows: torch.Tensor, counts: torch.Tensor, first_expert: int, weights: torch.Tensor):
    """A different nonlinear map per global expert: tanh(rows @ W_e)."""
    global_ids = torch.arange(first_expert, first_expert + counts.numel()).repeat_interleave(
        counts, output_size=rows.shape[0])
    return torch.tanh(torch.einsum("rl,rlm->rm", rows, weights[global_ids]))


def dispatch_worker(rank, world_size, kind, tokens_per_rank, ranks_per_node=None, experts=E, k=K, dtype="float64",
                    fp8=False, chunks=1) -> list[dict]:
    """The dispatcher (flat, or by node with `ranks_per_node`; its tokens in `chunks`) in `dtype` (rows and
    experts; routing weights in float32 below float64, as the router's) and the local one in float64, on the
    same tokens: every rank's figures (check_dispatch asserts them in the test)."""
    dist.init_process_group("gloo")
    try:
        weights = torch.randn(experts, L, L, generator=torch.Generator().manual_seed(0), dtype=F64)
        tokens = tokens_per_rank[rank]
        x, idx, w = routing(kind, rank, tokens, experts, k)
        if ranks_per_node is None:
            tested = AllToAllTokenDispatcher(experts, dist.group.WORLD, rank, fp8=fp8, chunks=chunks)
        else:
            rail, node = expert_node_groups([list(range(world_size))], ranks_per_node, rank)
            tested = NodeTokenDispatcher(experts, rank, rail, node, fp8=fp8, chunks=chunks)
        row_dtype = getattr(torch, dtype)
        weight_dtype = F64 if row_dtype == F64 else torch.float32
        runs = {}
        for name, dispatcher, rows_as, weights_as in (("tested", tested, row_dtype, weight_dtype),
                                                       ("local", LocalTokenDispatcher(experts), F64, F64)):
            xi = x.to(rows_as).requires_grad_()
            wi = w.to(weights_as).requires_grad_()
            received = []

            def experts_on(rows, counts, dispatcher=dispatcher, rows_as=rows_as, received=received):
                received.append((rows.shape[0], counts))
                return expert_fn(rows, counts, dispatcher.first_local_expert, weights.to(rows_as))

            with HostReads() as reads:
                y = dispatcher.exchange(xi, idx, wi, experts_on)
            (y * torch.arange(1.0, L + 1, dtype=rows_as)).sum().backward()  # a gradient that differs per column
            runs[name] = {"reads": (reads.values_read, reads.shapes_read), "dtype": str(y.dtype).split(".")[1],
                          "calls": len(received), "rows": sum(rows for rows, _ in received),
                          "counts_whole": all(counts.numel() == dispatcher.num_local_experts
                                              and int(counts.sum()) == rows for rows, counts in received),
                          "values": (y.detach().double(), xi.grad.double(), wi.grad.double())}
        errors = []
        for tested_value, reference in zip(runs["tested"].pop("values"), runs["local"].pop("values"), strict=True):
            if row_dtype == F64:
                relative = (tested_value - reference).abs() / (reference.abs() + 1e-2)  # allclose's rtol, nearly
                errors.append(float(relative.max()) if reference.numel() else 0.0)
            else:
                errors.append(rel_rms(tested_value, reference) if reference.numel() else 0.0)
        figures = {**runs, "errors": errors}
        if ranks_per_node is not None:  # each token crossed once to each other node holding its experts
            nodes_of_token = idx // (experts // world_size) // ranks_per_node
            remote = sum(len(set(row) - {rank // ranks_per_node}) for row in nodes_of_token.tolist())
            figures["bytes_across_nodes"] = (tested.bytes_across_nodes,
                                             remote * row_bytes(L, x.to(row_dtype).element_size(), fp8))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, figures)
        return everyone
    finally:
        dist.destroy_process_group()


def check_dispatch(per_rank: list[dict], dtype: str, chunks: int, fp8: bool = False) -> list[int]:
    """Every rank's figures of dispatch_worker: its outputs and gradients the local reference's (to 1e-13 in
    float64; in bfloat16 within 1% rms, its rounding being 2^-9, or FP8_RMS with an FP8 payload); one host read
    an exchange (every chunk's split sizes at once: a CUDA run waits on its stream once) and none by the local
    dispatcher (nothing syncs behind our back: bincount, repeat_interleave without output_size); each chunk's
    expert call given whole per-expert counts; the bytes across nodes those of each token's distinct remote
    nodes. Returns the rows each rank received."""
    bound = 1e-13 if dtype == "float64" else FP8_RMS if fp8 else 1e-2
    for rank, figures in enumerate(per_rank):
        tested, local = figures["tested"], figures["local"]
        assert (tested["reads"], local["reads"]) == ((1, 0), (0, 0)), rank
        assert (tested["dtype"], local["dtype"]) == (dtype, "float64"), rank
        assert (tested["calls"], local["calls"]) == (chunks, 1), rank
        assert tested["counts_whole"] and local["counts_whole"], rank
        assert max(figures["errors"]) < bound, (rank, figures["errors"])
        if "bytes_across_nodes" in figures:
            sent, expected = figures["bytes_across_nodes"]
            assert sent == expected, rank
    return [figures["tested"]["rows"] for figures in per_rank]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "world_size", "tokens", "expected_received", "chunks"), [
    ("random", 2, [13, 7], None, 1),
    ("random", 4, [5, 0, 9, 3], None, 3),  # rank 1 has no tokens at all, and rank 3 a token a chunk
    ("empty_experts", 4, [6, 6, 6, 6], [48, 0, 0, 0], 1),
    ("all_to_one", 4, [4, 2, 3, 1], [0, 0, 20, 0], 2),  # experts 4 and 5 live on rank 2
], ids=["random-ep2", "random-ep4-empty-rank-3-chunks", "empty-experts-ep4", "all-to-one-ep4-2-chunks"])
def test_all_to_all_dispatch_matches_local(kind, world_size, tokens, expected_received, chunks):
    """In chunks, each chunk's exchanges in flight while another's experts compute: the same results."""
    received = check_dispatch(run_distributed(dispatch_worker, world_size, kind, tokens, None, E, K, "float64", False,
                                               chunks), "float64", chunks)
    assert sum(received) == sum(tokens) * K
    if expected_received is not None:
        assert received == expected_received


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("nodes", "ranks_per_node", "tokens", "dtype", "chunks"), [
    (2, 2, [11, 0, 7, 5], "float64", 1),  # rank 1 has no tokens
    (2, 4, [9, 4, 6, 8, 3, 7, 5, 2], "float64", 2),
    (2, 2, [40, 33, 25, 37], "bfloat16", 1),
], ids=["2x2", "2x4-2-chunks", "2x2-bf16"])
def test_node_dispatch_matches_local(nodes, ranks_per_node, tokens, dtype, chunks):
    """Sent once per node and fanned out inside it: the local reference's output and every gradient, the bytes
    across nodes those of each token's distinct remote nodes (asserted on every rank)."""
    experts, k = 4 * nodes * ranks_per_node, 5
    received = check_dispatch(run_distributed(dispatch_worker, nodes * ranks_per_node, "random", tokens,
                                               ranks_per_node, experts, k, dtype, False, chunks), dtype, chunks)
    assert sum(received) == sum(tokens) * k


def quantile_worker(rank, world_size, dtype_name, rows_per_rank, mode):
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo")
    try:
        m = sum(rows_per_rank)
        gen = torch.Generator().manual_seed(7)
        skew = torch.linspace(1.5, -1.5, 16, dtype=F64)
        scores = torch.sigmoid(torch.randn(m, 16, generator=gen, dtype=F64) + skew).to(dtype)
        bias = (torch.randn(16, generator=gen, dtype=F64) * 0.1).to(dtype)
        start = sum(rows_per_rank[:rank])
        mine = scores[start:start + rows_per_rank[rank]]
        stats = GroupStatistics(dist.group.WORLD)
        from moe_pretrain.config import MoEConfig
        from moe_pretrain.model.balancing import make_balancer

        cfg = MoEConfig(num_experts=16, top_k=3, qb_rate=0.7, qb_quantile=mode)
        balancer = make_balancer(cfg)
        balancer.stats = stats
        balancer.observe(mine, torch.zeros(0, 3, dtype=torch.int64), bias)
        with HostReads() as reads:  # none: no sync on a GPU, and a dry run plays the same collectives
            new = balancer.next_bias(bias)
        everyone = [torch.empty_like(new) for _ in range(world_size)]
        dist.all_gather(everyone, new)
        identical = all(torch.equal(e, new) for e in everyone)
        if mode == "exact":
            reference = quantile_balance_update(scores, bias, 3, rate=0.7)
        else:  # one process's histogram of every score: integer counts sum exactly, so bit for bit
            one_process = make_balancer(cfg)
            one_process.observe(scores, torch.zeros(0, 3, dtype=torch.int64), bias)
            reference = one_process.next_bias(bias)
        return identical, float((new.double() - reference.double()).abs().max()), reads.total
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("dtype", "rows", "mode"), [("float64", [40, 25, 0, 31], "exact"),
                                                     ("float32", [50, 50, 50, 50], "exact"),
                                                     ("float32", [50, 0, 70, 30], "histogram")])
def test_distributed_quantile_balancing_is_that_of_one_process(dtype, rows, mode):
    identical, max_diff, host_reads = run_distributed(quantile_worker, len(rows), dtype, rows, mode)
    assert host_reads == 0
    assert identical  # bitwise the same bias on every rank
    # exact: the bisection finds exactly the sorted quantile; histogram: the summed counts are one process's.
    assert max_diff == 0.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("ranks_per_node", "chunks"), [(None, 1), (2, 2)], ids=["flat", "by-node-2x2-2-chunks"])
def test_fp8_dispatch_stays_within_e4m3_rounding(ranks_per_node, chunks):
    """parallel.dispatch_fp8 in bf16 against the local dispatcher in float64 (FP8_RMS), every gradient included."""
    received = check_dispatch(run_distributed(dispatch_worker, 4, "random", [40, 33, 25, 37], ranks_per_node, 32, 5,
                                               "bfloat16", True, chunks), "bfloat16", chunks, fp8=True)
    assert sum(received) == (40 + 33 + 25 + 37) * 5


def overlap_worker(rank, world_size, chunks):
    """One exchange of 64 tokens in `chunks` chunks, forward then backward, each laid out on the dry run's
    timeline (planning/timeline.py): (ep time on its links, ep time the compute waited for) per pass."""
    from moe_pretrain.config import ClusterConfig
    from moe_pretrain.gpus import GPUS
    from moe_pretrain.planning.collective_traffic import CollectiveTraffic
    from moe_pretrain.planning.op_census import OpCensus
    from moe_pretrain.planning.timeline import Timeline
    from parallel.collectives import observing

    dist.init_process_group("gloo")
    try:
        weights = torch.randn(E, L, L, generator=torch.Generator().manual_seed(0), dtype=F64)
        x, idx, w = routing("random", rank, 64)
        x.requires_grad_()
        dispatcher = AllToAllTokenDispatcher(E, dist.group.WORLD, rank, chunks=chunks)
        cluster = ClusterConfig(gpus_per_node=1)  # every exchange on the NIC

        def experts(rows, counts):
            return expert_fn(rows, counts, dispatcher.first_local_expert, weights)

        passes, out = [], []
        for backward in (False, True):
            timeline = Timeline()
            with OpCensus(GPUS["h200"], timeline), observing(timeline), \
                    CollectiveTraffic({"ep": dist.group.WORLD}, cluster, timeline):
                if backward:
                    out[0].sum().backward()
                else:
                    out.append(dispatcher.exchange(x, idx, w, experts))
            timeline.finish(micro_batches=1)
            passes.append((timeline.link_s["ep"], timeline.exposed_s["ep"]))
        return passes
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_chunks_hide_exchanges_behind_the_other_chunks_compute_forward_and_backward():
    """In one chunk the compute waits for nearly every exchange (the forward's regrouping indices are computed
    while its rows travel: 95% exposed; the backward 100%); in two, part of each pass's exchanges runs while
    the other chunk computes (73% and 77% exposed here): in the forward by the chunks' order, in the backward
    by the autograd engine's, which runs the later-made of its ready nodes first."""
    (forward, backward) = run_distributed(overlap_worker, 2, 1)
    assert forward[1] > 0.9 * forward[0] and backward[1] == pytest.approx(backward[0])
    (forward, backward) = run_distributed(overlap_worker, 2, 2)
    assert forward[1] < 0.8 * forward[0] and backward[1] < 0.8 * backward[0], (forward, backward)
