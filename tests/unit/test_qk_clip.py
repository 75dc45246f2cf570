"""QK-clip (model/qk_clip.py): the recorded maxima against explicit logits, and a head forced above the
threshold clipped to it with the other heads untouched. (Layouts: tests/distributed/test_parallel_training.py.)"""

import copy
import math

import pytest
import torch
from torch import nn

from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.qk_clip import clip_heads, document_max_logits, start_recording
from moe_pretrain.ops.latent_attention import latent_causal_attention
from parallel.optimizer import ParamGroupSpec, ShardedOptimizer
from tests.models import F64, make_layer


def explicit_max_logits(q: torch.Tensor, k: torch.Tensor, doc_ids: list[int], scale: float) -> torch.Tensor:
    """Per head, the largest scale q_t . k_s over s <= t in t's document: every pair written out."""
    heads = q.shape[1]
    return torch.tensor([max(float(q[t, h] @ k[s, h]) * scale for t in range(q.shape[0]) for s in range(t + 1)
                             if doc_ids[s] == doc_ids[t]) for h in range(heads)], dtype=F64)


def test_recorded_maxima_are_the_largest_logits_within_documents():
    """document_max_logits (the SDPA path's record, blocks of 3 queries) and the latent exchange's running
    maximum against every pair written out (1e-12); a key in another document or the future never counts."""
    torch.manual_seed(0)
    doc_ids = [0] * 5 + [1] * 4 + [2] * 3
    bounds = [0, 5, 9, 12]
    q, k = torch.randn(12, 2, 6, dtype=F64), torch.randn(12, 2, 6, dtype=F64)
    k[11] = 100.0 * q[0]  # huge with query 0, which is in another document and earlier: never a pair
    want = explicit_max_logits(q, k, doc_ids, 0.5)
    assert torch.allclose(document_max_logits(q, k, bounds, 0.5, block=3), want, rtol=0, atol=1e-12)
    v = torch.randn(12, 2, 3, dtype=F64)
    _, maxima = latent_causal_attention(q, list(range(12)), torch.zeros(12, 1, dtype=F64), bounds,
                                        lambda _block, a, b: (k[a:b], v[a:b]), [], 0.5, query_block=4,
                                        key_block=5, max_logits=True)
    assert torch.allclose(maxima, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("position", ["nope", "rope"])
def test_a_head_above_the_threshold_is_clipped_to_it(position):
    """Head 1's query rows scaled x 30 push its logits far above the others'; with a threshold between, the clip
    brings head 1's largest logit on the same input to the threshold (1e-9) and leaves heads 0 and 2 (weights
    bitwise, maxima) as they were."""
    layer, cfg = make_layer(position)
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    with torch.no_grad():
        layer.q_up.weight.view(cfg.num_heads, nope + rope, -1)[1] *= 30.0
    model = nn.ModuleDict({"mixer": layer})
    x = torch.randn(2, 9, 16, dtype=F64)
    layout = DocumentLayout.from_doc_ids(torch.tensor([[0] * 4 + [1] * 5, [0] * 9]))

    def maxima() -> torch.Tensor:
        start_recording(model)
        layer(x, layout)
        return layer.max_logits.value

    before = maxima()
    others = before[[0, 2]]
    threshold = float(others.max()) * 2
    assert float(before[1]) > 3 * threshold
    q_up, kv_up = layer.q_up.weight.detach().clone(), layer.kv_up.weight.detach().clone()
    reduced = clip_heads(model, threshold)
    assert torch.equal(reduced, before[None])
    after = maxima()
    assert math.isclose(float(after[1]), threshold, rel_tol=1e-9)
    assert torch.equal(after[[0, 2]], others)
    for weight, rows in ((layer.q_up.weight, nope + rope), (layer.kv_up.weight, nope + cfg.v_head_dim)):
        old = (q_up if weight is layer.q_up.weight else kv_up).view(cfg.num_heads, rows, -1)
        new = weight.detach().view(cfg.num_heads, rows, -1)
        assert torch.equal(new[[0, 2]], old[[0, 2]]) and not torch.equal(new[1], old[1])
    with torch.no_grad():  # evaluation forwards record nothing
        start_recording(model)
        layer(x, layout)
    assert layer.max_logits.value is None


def test_a_recomputed_layer_does_not_pass_over_the_logits_again(monkeypatch):
    """Under full recomputation a layer runs twice (forward, and again in backward up to its last product, past
    the attention core); the maxima pass runs in the first only, and records what a layer without
    recomputation records (bitwise)."""
    import moe_pretrain.model.mla as mla
    from moe_pretrain.model.recompute import maybe_recompute

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return document_max_logits(*args, **kwargs)

    monkeypatch.setattr(mla, "document_max_logits", counted)
    layer, _ = make_layer("nope")
    model = nn.ModuleDict({"mixer": layer})
    x = torch.randn(2, 9, 16, dtype=F64, requires_grad=True)
    layout = DocumentLayout.from_doc_ids(torch.tensor([[0] * 4 + [1] * 5, [0] * 9]))
    recorded = {}
    for recompute in (False, True):
        start_recording(model)
        calls.clear()
        maybe_recompute(recompute, lambda x: layer(x, layout), x).sum().backward()
        recorded[recompute] = layer.max_logits.value
        assert len(calls) == 1, recompute
    assert torch.equal(recorded[True], recorded[False])


def test_the_clip_scales_a_bf16_held_weights_master_as_it_scales_an_fp32_weight():
    """train.param_dtype=bfloat16: q_up and kv_up held in bf16 with fp32 masters in the optimizer. The clip,
    through the optimizer's scale_rows, scales the masters bitwise as it scales fp32 weights (the next
    update and gather keep it), and the held weights to within bf16's rounding until the masters are gathered."""
    layer, cfg = make_layer("rope")
    layer.float()
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    with torch.no_grad():
        layer.q_up.weight.view(cfg.num_heads, nope + rope, -1)[1] *= 30.0
    model = nn.ModuleDict({"mixer": layer})
    start_recording(model)
    layer(torch.randn(2, 9, 16), DocumentLayout.from_doc_ids(torch.tensor([[0] * 4 + [1] * 5, [0] * 9])))
    threshold = float(layer.max_logits.value[[0, 2]].max()) * 2
    held = copy.deepcopy(model)  # with the same recorded maxima
    clip_heads(model, threshold)
    weights = [held["mixer"].q_up.weight, held["mixer"].kv_up.weight]
    optimizer = ShardedOptimizer([ParamGroupSpec(list(held.parameters()), None, 0.0)], lr=1e-3, betas=(0.9, 0.95),
                                 eps=1e-8, bucket_bytes=2**30, norm_group=None,
                                 held_in={id(w): torch.bfloat16 for w in weights})
    clip_heads(held, threshold, scale_rows=optimizer.scale_rows)
    bucket = next(b for b in optimizer.buckets if b.master is not None)
    for weight, clipped in zip(weights, [layer.q_up.weight, layer.kv_up.weight]):
        offset = bucket.offsets[next(i for i, p in enumerate(bucket.params) if p is weight)]
        assert weight.dtype == torch.bfloat16
        assert torch.equal(bucket.master[offset:offset + weight.numel()].view_as(weight), clipped.detach())
        assert torch.allclose(weight.float(), clipped.detach(), rtol=2**-7, atol=0)
    optimizer.refresh_parameters()
    assert all(torch.equal(w, c.detach().to(torch.bfloat16)) for w, c in zip(weights, [layer.q_up.weight,
                                                                                       layer.kv_up.weight]))
