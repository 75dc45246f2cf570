"""The keys an MLA query attends to, from the documents a row packs, and the plan's attention priced at them
(planning/documents.py, sizing.mixing_flops_per_token); what MLA's latent exchange expands and meets under
the same documents (documents.exchange_spans against ops/latent_attention.py's own tiling)."""

import dataclasses

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.model.counts import attended_keys
from moe_pretrain.model.layout import document_starts
from moe_pretrain.ops.latent_attention import _Visibility
from moe_pretrain.planning.documents import exchange_spans, stage_doc_ids
from moe_pretrain.planning.sizing import ExchangeSpan, StageDocuments, stage_flops_per_token
from parallel.latent_route import LatentRoute


def test_a_query_attends_to_the_keys_of_its_document_up_to_itself():
    rows = torch.tensor([[0, 0, 0, 1, 1], [2, 2, 2, 2, 2]])
    assert attended_keys(rows) == (3 * 4 / 2 + 2 * 3 / 2 + 5 * 6 / 2) / 10  # 2.4 keys per query
    assert attended_keys(torch.zeros(3, 8, dtype=torch.long)) == 4.5  # one document per row: (T + 1) / 2


def test_the_plan_prices_mla_attention_at_the_keys_the_stages_data_gives():
    cfg = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml"])
    seq_len = cfg.stages[2].seq_len
    keys = attended_keys(stage_doc_ids(cfg, 2, rows=4))
    assert 1 <= keys < seq_len / 2  # the embedded corpus packs several documents into a row of 1024
    m, layers = cfg.model, list(range(cfg.model.num_layers))
    mla = [i for i in layers if m.layer_kind(i) == "mla"]
    a = m.mla
    per_key = 3 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    stage = dataclasses.replace(resolve_stages(cfg)[2], recompute="full", cp=1)
    whole_row = stage_flops_per_token(m, layers, True, stage)
    assert stage_flops_per_token(m, layers, True, stage, documents=StageDocuments(seq_len / 2)) == whole_row
    # forward and backward, the re-forward of full recomputation (1/3) and the backward's recomputed scores (1/6)
    saved = len(mla) * per_key * (seq_len / 2 - keys) * (1 + 1 / 3 + 1 / 6)
    priced = stage_flops_per_token(m, layers, True, stage, documents=StageDocuments(keys))
    assert priced == pytest.approx(whole_row - saved, rel=1e-12)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_exchange_spans_follow_the_latent_attentions_own_tiling(rows):
    """documents.exchange_spans (closed form, host integers) against ops/latent_attention.py's visibility built
    from each cp rank's compact keys and query positions (parallel/latent_route.py): the key blocks a rank
    expands, the keys its tiles meet and the keys it sends and receives, exactly, on rows of random documents;
    one document per row gives rank 0 every key (the plan's bound: cp keys a local position) and rank r sends
    its front fragment to cp - 1 ranks and its back one to r."""
    seq_len, cp, block = 256, 4, 16
    F, local = seq_len // (2 * cp), rows * seq_len / cp
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 80, (rows * seq_len,), generator=generator)
    doc_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:rows * seq_len].view(rows, seq_len)
    bounds = document_starts(doc_ids).tolist()
    spans = exchange_spans(doc_ids, rows, cp, block)
    for rank in range(cp):
        route = LatentRoute.of(bounds, rows, seq_len, cp, rank)
        seen = _Visibility(route.query_index, route.bounds, block, block, len(route.needed) * F)
        expanded = met = 0
        for (k0, k1), tiles in zip(seen.key_blocks, seen.tiles_seeing, strict=True):
            expanded += (k1 - k0) * bool(tiles)
            met += (k1 - k0) * sum(q1 - q0 for q0, q1 in (seen.query_tiles[t] for t in tiles))
        want = ExchangeSpan(expanded / local, met / local, sum(route.input_splits) * F / local,
                            sum(route.output_splits) * F / local)
        assert spans[rank] == pytest.approx(want), rank
        assert spans[rank].expanded_keys < cp  # short documents: some fragments, never all of them
    one_document = exchange_spans(torch.zeros(rows, seq_len, dtype=torch.long), rows, cp, block)
    assert one_document[0].expanded_keys == cp
    assert [s.sent_keys for s in one_document] == [(cp - 1 + r) / 2 for r in range(cp)]
    assert [s.received_keys for s in one_document] == [(2 * cp - 2 - r) / 2 for r in range(cp)]
    assert StageDocuments(1.0, one_document).span().sent_keys == cp - 1  # the busiest: the plan's bound
