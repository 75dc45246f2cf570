"""The keys an MLA query attends to, from the documents a row packs, and the plan's attention priced at them
(planning/documents.py, sizing.mixing_flops_per_token)."""

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.planning.documents import attended_keys, stage_attended_keys
from moe_pretrain.planning.sizing import stage_flops_per_token


def test_a_query_attends_to_the_keys_of_its_document_up_to_itself():
    rows = torch.tensor([[0, 0, 0, 1, 1], [2, 2, 2, 2, 2]])
    assert attended_keys(rows) == (3 * 4 / 2 + 2 * 3 / 2 + 5 * 6 / 2) / 10  # 2.4 keys per query
    assert attended_keys(torch.zeros(3, 8, dtype=torch.long)) == 4.5  # one document per row: (T + 1) / 2


def test_the_plan_prices_mla_attention_at_the_keys_the_stages_data_gives():
    cfg = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml"])
    seq_len = cfg.stages[2].seq_len
    keys = stage_attended_keys(cfg, 2, rows=4)
    assert 1 <= keys < seq_len / 2  # the embedded corpus packs several documents into a row of 1024
    m, layers = cfg.model, list(range(cfg.model.num_layers))
    mla = [i for i in layers if m.layer_kind(i) == "mla"]
    a = m.mla
    per_key = 3 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    whole_row = stage_flops_per_token(m, layers, True, seq_len, "full")
    assert stage_flops_per_token(m, layers, True, seq_len, "full", keys=seq_len / 2) == whole_row
    # forward and backward, the re-forward of full recomputation (1/3) and the backward's recomputed scores (1/6)
    saved = len(mla) * per_key * (seq_len / 2 - keys) * (1 + 1 / 3 + 1 / 6)
    assert stage_flops_per_token(m, layers, True, seq_len, "full", keys=keys) == pytest.approx(whole_row - saved,
                                                                                             rel=1e-12)
