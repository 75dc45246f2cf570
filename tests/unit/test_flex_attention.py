"""gpu_kernels/flex_attention.py (MLA's GPU attention path) against the per-document SDPA reference, forward on a
CPU (FlexAttention compiles its forward here; its backward is CUDA-only, tests/gpu/test_flex_attention_gpu.py)."""

import pytest
import torch

from gpu_kernels.choice import Kernels
from gpu_kernels.flex_attention import document_block_mask, flex_document_attention, flex_unavailable_reason
from moe_pretrain.model.init import initialize
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mla import GatedMLA
from moe_pretrain.ops.document_attention import document_causal_attention
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.planning.torch_calls import TorchCalls
from tests.models import tiny_config

ROWS, T = 2, 160
"""Two rows of 160 positions: N = 320 flattened, three 128-blocks, the last ragged (one compiled shape)."""
LAYOUTS = {
    "one document per row": [0, 160, 320],
    "documents crossing blocks, single tokens, a block-aligned start": [0, 1, 2, 100, 128, 160, 161, 300, 320],
    "many short documents": list(range(0, 321, 10)),
}


def mla_forward_calls(layer: GatedMLA, x: torch.Tensor, doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    layout = DocumentLayout.from_doc_ids(doc_ids)
    layout.attention_mask  # noqa: B018  (built once per forward, outside the layer)
    layout.document_bounds  # noqa: B018
    with TorchCalls() as calls:
        out = layer(x, layout)
    return out, calls.calls


@pytest.mark.timeout(300)
@torch.no_grad()
def test_flex_attention_matches_the_reference_and_an_mla_layer_issues_the_same_ops_for_any_documents():
    """float32: FlexAttention against one SDPA per document within 1e-5 (measured ~1e-6: the online
    softmax's summation order), q / k head dim 12 and v's 8 as the TINY model has them, for every document
    layout; its block mask is built with no host read. Then an MLA layer's forward on 1 and 32 documents per
    row: with FlexAttention it calls the same torch functions (one attention launch, whatever the documents),
    with the reference it calls more for more documents (one SDPA each)."""
    cfg = tiny_config().model.mla
    D, Dv, H = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_heads
    gen = torch.Generator().manual_seed(0)
    for name, bounds in LAYOUTS.items():
        q, k = (torch.randn(ROWS * T, H, D, generator=gen) for _ in range(2))
        v = torch.randn(ROWS * T, H, Dv, generator=gen)
        with HostReads() as reads:
            mask = document_block_mask(torch.tensor(bounds), ROWS * T)
        assert reads.total == 0, name
        got = flex_document_attention(q, k, v, mask, 0.3)
        want = document_causal_attention(q, k, v, bounds, 0.3)
        assert (got - want).abs().max() < 1e-5, name

    flex_layer = initialize(GatedMLA(32, cfg, init_std=0.02, out_std=0.02, kernels=Kernels(attention="flex")), 0)
    layer = initialize(GatedMLA(32, cfg, init_std=0.02, out_std=0.02), 0).eval()  # the same values, sdpa
    flex_layer.eval()
    x = torch.randn(ROWS, T, 32, generator=gen)
    one = torch.arange(ROWS).unsqueeze(1).expand(ROWS, T)
    many = torch.arange(T).div(T // 32, rounding_mode="floor").expand(ROWS, T)  # 32 documents per row
    flex_one, flex_one_calls = mla_forward_calls(flex_layer, x, one)
    flex_many, flex_many_calls = mla_forward_calls(flex_layer, x, many)
    ref_one, ref_one_calls = mla_forward_calls(layer, x, one)
    ref_many, ref_many_calls = mla_forward_calls(layer, x, many)
    assert (flex_one - ref_one).abs().max() < 1e-5 and (flex_many - ref_many).abs().max() < 1e-5
    assert flex_one_calls == flex_many_calls
    assert ref_many_calls >= ref_one_calls + 30  # one SDPA (and a slice of each input) per extra document


def test_flex_attention_is_refused_for_heads_narrower_than_its_gpu_lowering_takes():
    """FlexAttention's GPU lowering refuses heads under 16 wide (an H200 raised it at the first compile for the
    tiny model's 12 / 8): on a GPU auto keeps the reference and says why, naming the keys."""
    reason = flex_unavailable_reason(torch.device("cuda"), True, 12, 8)
    assert reason == ("FlexAttention takes heads of 16 or more, not 12 (model.mla.qk_nope_head_dim + qk_rope_head_dim)"
                      " / 8 (model.mla.v_head_dim)")
    assert flex_unavailable_reason(torch.device("cuda"), True, 192, 128) is None
    assert flex_unavailable_reason(torch.device("cpu"), True, 12, 8) == "FlexAttention has no backward on cpu"
