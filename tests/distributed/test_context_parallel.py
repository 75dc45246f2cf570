"""Context parallelism against one process on the same sequences (gloo, 2, 4 and 8 processes, float64),
MLA by Ulysses and by the latent (with more cp ranks than MLA heads).

The tiny model's forward + backward on rows packed with several documents: a single-token document, a
boundary exactly on a context-parallel rank's edge, fragments (T / 2 cp) that are not a multiple of the
KDA chunk. Each rank's logits equal the single process's at its positions, and the parameter gradients
summed over the cp ranks equal the single process's, within 1e-9 (float64) and 1e-4 (fp32).
"""

import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from parallel.parallelize import build_model
from parallel.state import destroy_parallel, init_parallel
from tests.helpers import rel_rms
from tests.models import tiny_config

T = 96
BOUNDARIES = [24, 30, 31, 50, 72]
"""Document starts: 24 is a fragment edge for cp 2 (fragments of 24) and cp 4 (of 12); 30 starts a
one-token document; the tiny model's KDA chunk is 16, which divides neither 24 nor 12."""


def model_config(*overrides):
    return tiny_config("train.dtype=float64", "model.mla.num_heads=4", *overrides)


def inputs(vocab: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, T), generator=gen)
    doc_ids = torch.zeros(2, T, dtype=torch.int64)
    for start in BOUNDARIES:
        doc_ids[0, start:] += 1
    # The second row: one document over three fragments (its state crosses two fragment edges, so the
    # fold composes the summaries' M), then one starting on a fragment edge.
    doc_ids[1, 72:] = 1
    weight = torch.randn(2, T, vocab, generator=gen, dtype=torch.float64)
    return tokens, doc_ids, weight


def forward_backward(model, tokens, doc_ids, weight, local=lambda x: x):
    """local: what keeps this rank's positions of a tensor over every position."""
    logits, balance = model(tokens, doc_ids)
    (logits * local(weight)).sum().add(balance).backward()
    return logits.detach()


def cp_worker(rank, world_size, overrides):
    cfg = model_config(f"parallel.cp={world_size}", *overrides)
    ctx = init_parallel(cfg)
    try:
        model = build_model(cfg, ctx)
        context = ctx.context(world_size)
        logits = forward_backward(model, *inputs(cfg.model.vocab_size), local=context.local)
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is not None:  # (the patch embedding sees no images here)
                # Each rank's gradient covers its own positions only.
                dist.all_reduce(p.grad, group=ctx.context(world_size).group)
                grads[name] = p.grad
        return logits, (context.rank, 2 * world_size - 1 - context.rank), grads
    finally:
        destroy_parallel()


LATENT = ["model.mla.num_heads=2", "parallel.cp_mla=latent"]
"""MLA by the latent with 2 heads: cp 4 and 8 exceed the heads (Ulysses could not split them)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "overrides", "tolerance"), [
    (4, [], 1e-9), (2, ["train.recompute=full"], 1e-9), (2, ["train.dtype=float32"], 1e-4),
    (2, [*LATENT, "model.mla.position=rope"], 1e-9), (4, LATENT, 1e-9), (8, LATENT, 1e-9),
], ids=["cp4", "cp2-recompute", "cp2-fp32", "cp2-latent-rope", "cp4-latent", "cp8-latent"])
def test_context_parallel_matches_one_process(world_size, overrides, tolerance):
    cfg = model_config(*(o for o in overrides if not o.startswith("parallel.")))  # one process: no cp settings
    model = build_model(cfg)
    expected = forward_backward(model, *inputs(cfg.model.vocab_size))
    logits, fragments, grads = run_distributed(cp_worker, world_size, overrides)
    pieces = expected.unflatten(1, (2 * world_size, T // (2 * world_size)))
    assert rel_rms(logits, pieces[:, list(fragments)].flatten(1, 2)) < tolerance
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, grad in grads.items():
        assert rel_rms(grad, model.get_parameter(name).grad) < tolerance, name


def scan_worker(rank, world_size):
    """entry_states on random summaries of two rows (float64): the entry states and the summaries' gradients
    under a random weighting, and the payload bytes the cp group's all-to-alls carried."""
    from moe_pretrain.planning.collective_traffic import CollectiveTraffic
    from parallel.collectives import gather_objects
    from parallel.context_parallel import ContextParallel

    dist.init_process_group("gloo")
    try:
        context = ContextParallel(dist.group.WORLD)
        gen = torch.Generator().manual_seed(rank)
        H, K = 2, 3  # V = K
        M = (0.5 * torch.randn(2 * 2, H, K, K, generator=gen, dtype=torch.float64)).requires_grad_()
        Bs = torch.randn(2 * 2, H, K, K, generator=gen, dtype=torch.float64).requires_grad_()
        with CollectiveTraffic({"cp": dist.group.WORLD}) as traffic:
            entries = context.entry_states(M, Bs)
            weight = torch.randn(entries.shape, generator=gen, dtype=torch.float64)
            (entries * weight).sum().backward()
        sent = traffic.bytes[("cp", "alltoall_base_")]
        return gather_objects((M.detach(), Bs.detach(), weight, entries.detach(), M.grad, Bs.grad, sent),
                              dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_entry_state_scan_matches_the_fold_and_sends_what_the_plan_counts():
    """cp 8 (16 fragments, each rank's two pieces of two rows): every fragment's entry state and every summary's
    gradient equal the sequence-order fold S_{j+1} = M_j S_j + B_j of all summaries in one process (1e-12), and
    the all-to-alls' payloads summed over the ranks are the forward's and the backward's 16 - d summaries per
    round d of the shift (1) and the scan (1, 2, 4, 8), two rows each: 64 summaries a pass, against the
    all-gather's 8 x 16 x 7 / 8 = 112 sent (the plan's scan_summaries is this count over the ranks); each rank
    sends what its fragments pass on forward and what they received backward (scan_summaries of that rank)."""
    from moe_pretrain.planning.context_parallel_costs import scan_summaries

    cp = 8
    results = run_distributed(scan_worker, cp)
    n, H, K, rows = 2 * cp, 2, 3, 2
    M = torch.zeros(n, rows, H, K, K, dtype=torch.float64, requires_grad=False)
    Bs = torch.zeros_like(M)
    for rank, (m, b, *_) in enumerate(results):  # rank r holds fragments r and 2 cp - 1 - r of each row
        for slot, j in enumerate((rank, n - 1 - rank)):
            M[j], Bs[j] = m.unflatten(0, (rows, 2))[:, slot], b.unflatten(0, (rows, 2))[:, slot]
    M.requires_grad_(), Bs.requires_grad_()
    state, entries = torch.zeros_like(Bs[0]), []
    for j in range(n):
        entries.append(state)
        state = M[j] @ state + Bs[j]
    loss = 0
    for rank, (_, _, weight, got, *_) in enumerate(results):
        for slot, j in enumerate((rank, n - 1 - rank)):
            want = entries[j]
            assert torch.allclose(got.unflatten(0, (rows, 2))[:, slot], want, rtol=1e-12, atol=1e-12), (rank, j)
            loss = loss + (want * weight.unflatten(0, (rows, 2))[:, slot]).sum()
    loss.backward()
    for rank, (_, _, _, _, grad_M, grad_B, _) in enumerate(results):
        for slot, j in enumerate((rank, n - 1 - rank)):
            assert torch.allclose(grad_M.unflatten(0, (rows, 2))[:, slot], M.grad[j], rtol=1e-12, atol=1e-12)
            assert torch.allclose(grad_B.unflatten(0, (rows, 2))[:, slot], Bs.grad[j], rtol=1e-12, atol=1e-12)
    summary_bytes = rows * H * K * 2 * K * 8
    sent = sum(r[-1] for r in results)
    assert sent == 2 * (15 + 15 + 14 + 12 + 8) * summary_bytes
    assert sent == 2 * cp * scan_summaries(cp)[0] * summary_bytes
    for rank, result in enumerate(results):  # rank by rank: what it sends forward and, backward, what it received
        assert result[-1] == sum(scan_summaries(cp, rank)) * summary_bytes, rank
