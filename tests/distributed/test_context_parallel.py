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
