"""Whole-model behaviour: AttnRes bank bookkeeping, document isolation, images, dtypes."""

import pytest
import torch

from moe_pretrain.data.patches import PlacedImage, placed_images
from moe_pretrain.model import DocumentLayout, MoETransformer
from moe_pretrain.model.init import initialize
from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.ops import rms_norm
from tests.helpers import rel_rms
from tests.models import tiny_config

F64 = torch.float64


def build(*overrides, seed=0, dtype=F64):
    torch.manual_seed(seed)
    cfg = tiny_config(*overrides)
    model = initialize(MoETransformer(cfg.model).to(dtype), seed)
    # Non-zero pseudo-queries so the mixes are real softmaxes, not plain averages.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pseudo_query" in name:
                p.normal_(0, 0.5)
    return model, cfg


def reference_forward(model: MoETransformer, tokens: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """docs/model.md's AttnRes written with explicit lists: completed blocks + the current block's outputs."""
    cfg = model.cfg

    def mix(module, entries):
        if len(entries) == 1:
            return entries[0]
        stacked = torch.stack(entries)
        scores = (rms_norm(stacked, module.norm_weight, module.eps) @ module.pseudo_query.weight[0])
        return (torch.softmax(scores, 0).unsqueeze(-1) * stacked).sum(0)

    blocks = [model.embedding(tokens)]
    current: list[torch.Tensor] = []
    for i in range(cfg.num_layers):
        layer = model.layers[str(i)]
        visible = blocks + ([sum(current)] if current else [])
        current.append(layer.mixer(layer.attn_norm(mix(layer.attn_mix, visible)), layout))
        out = layer.mlp(layer.mlp_norm(mix(layer.mlp_mix, [*blocks, sum(current)])))
        current.append(out[0] if isinstance(out, tuple) else out)
        if (i + 1) % cfg.attn_res.block_size == 0:
            blocks.append(sum(current))
            current = []
    h = mix(model.final_mix, blocks + ([sum(current)] if current else []))
    return model.head(model.final_norm(h))


@pytest.mark.parametrize("block_size", [1, 2, 4, 6])
def test_attn_res_bank_matches_reference(block_size):
    model, _ = build(f"model.attn_res.block_size={block_size}")
    model.eval()
    tokens = torch.randint(0, 256, (2, 20))
    layout = DocumentLayout.single_documents(2, 20, tokens.device)
    logits, _ = model(tokens)
    assert rel_rms(logits, reference_forward(model, tokens, layout)) < 1e-12


def test_packed_documents_do_not_see_each_other():
    """KDA state, short convolutions and MLA masks all stop at a document boundary."""
    model, _ = build()
    model.eval()
    a, b = torch.randint(0, 256, (1, 13)), torch.randint(0, 256, (1, 19))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 13 + [1] * 19])
    logits, _ = model(packed, doc_ids)
    alone_a, _ = model(a)
    alone_b, _ = model(b)
    assert rel_rms(logits[:, :13], alone_a) < 1e-12
    assert rel_rms(logits[:, 13:], alone_b) < 1e-12


def test_short_convolution_respects_document_starts():
    torch.manual_seed(0)
    cfg = tiny_config().model
    layer = initialize(KimiDeltaAttention(32, cfg.kda, norm_eps=1e-5, init_std=0.3, out_std=0.3).to(F64), seed=0)
    x = torch.randn(1, 10, 32, dtype=F64)
    layout = DocumentLayout.from_doc_ids(torch.tensor([[0] * 3 + [1] * 7]))
    got = layer(x, layout)
    alone = layer(x[:, 3:], DocumentLayout.single_documents(1, 7, x.device))
    assert rel_rms(got[:, 3:], alone) < 1e-12


def test_images_enter_at_their_positions_and_influence_later_text():
    model, cfg = build()
    model.eval()
    tokens = torch.randint(0, 256, (1, 12))
    image_mask = torch.zeros(1, 12, dtype=torch.bool)
    image_mask[0, 2:5] = True
    # 2 x 2 patches: 1 token (position 2); 2 x 4: 2 tokens (positions 3, 4)
    images = [PlacedImage(0, 2, (1, 2, 2)), PlacedImage(0, 3, (1, 2, 4))]
    patches = torch.randn(4 + 8, cfg.model.vision.patch_dim, dtype=F64)
    with_image, _ = model(tokens, None, patches, image_mask, images)
    other_image, _ = model(tokens, None, patches + 1.0, image_mask, images)
    # Causal: earlier positions unaffected. Not bitwise: later tokens change expert group sizes and
    # with them the GEMM blocking, so 1e-13 allows round-off only.
    assert rel_rms(with_image[:, :2], other_image[:, :2]) < 1e-13
    assert not torch.allclose(with_image[:, 5:], other_image[:, 5:])
    # The second image alone changes the first image's token not at all: attention stays within an image.
    second_only = torch.cat([patches[:4], patches[4:] + 1.0])
    changed, _ = model(tokens, None, second_only, image_mask, images)
    assert rel_rms(with_image[:, :3], changed[:, :3]) < 1e-13
    with pytest.raises(RuntimeError, match="mark exactly the images' tokens"):  # a device-side assert (no host read)
        model(tokens, None, patches[:8], image_mask, images[1:])


def test_dense_first_layer_and_moe_elsewhere():
    model, cfg = build("model.dense_layers=2")
    kinds = [isinstance(model.layers[str(i)].mlp, LatentMoE) for i in range(cfg.model.num_layers)]
    assert kinds == [False, False, True, True, True, True]
    assert sorted(model.routers()) == [2, 3, 4, 5]


def test_router_stays_fp32_under_bf16_autocast():
    model, _ = build(dtype=torch.float32)
    router = model.routers()[1]
    seen = {}
    original = router.balancer.observe

    def spy(scores, topk_idx, bias):
        seen["dtype"] = scores.dtype
        original(scores, topk_idx, bias)

    router.balancer.observe = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.bfloat16
    assert seen["dtype"] == torch.float32


def test_bias_update_changes_routing_bias_only_in_training():
    model, _ = build()
    tokens = torch.randint(0, 256, (2, 16))
    model.eval()
    model(tokens)
    model.update_balancing()
    assert all(torch.equal(r.expert_bias, torch.zeros_like(r.expert_bias)) for r in model.routers().values())
    model.train()
    model(tokens)
    model.update_balancing()
    assert all(r.expert_bias.abs().sum() > 0 for r in model.routers().values())


def test_future_tokens_never_change_past_logits():
    """Causality of the whole model on a real packed batch with images (KDA chunks, convs, MLA, MoE)."""
    from moe_pretrain.data import PretrainingData

    model, cfg = build("data.seq_len=128", "data.image_fraction=0.3", "data.text_doc_bytes=100")
    model.eval()
    batch = PretrainingData(cfg).next_batch(2)
    assert batch.image_mask.any()
    patches = batch.patches.double()
    logits, _ = model(batch.tokens, batch.doc_ids, patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
    changed = batch.tokens.clone()
    text = ~batch.image_mask[:, 70:]
    changed[:, 70:][text] = (changed[:, 70:][text] + 7) % 256
    logits2, _ = model(changed, batch.doc_ids, patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
    # 1e-13: expert group sizes change with the later tokens (GEMM blocking), nothing else may.
    assert rel_rms(logits[:, :70], logits2[:, :70]) < 1e-13
    assert rel_rms(logits[:, 70:], logits2[:, 70:]) > 1e-3


def test_a_rank_moves_to_the_device_only_the_images_it_encodes():
    """A batch on the device leaves its patches in host memory (data.Batch.to), and encoding copies to the
    weights' device and dtype exactly the images asked for: a first pipeline stage never holds the step's
    whole batch of patches (up to about four a position) beside the model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_pretrain.data import PretrainingData

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default:
                self.made.append((tuple(out.shape), out.dtype))
            return out

    model, cfg = build("data.seq_len=128", "data.image_fraction=0.3", "data.text_doc_bytes=100", dtype=torch.bfloat16)
    batch = PretrainingData(cfg).next_batch(2)
    assert batch.to("meta").tokens.is_meta and batch.to("meta").patches.device.type == "cpu"
    images = placed_images(batch.grids, batch.starts)
    assert len(images) >= 2 and batch.patches.dtype == torch.float32
    with Copies() as copies:
        tokens = model.encode_images(batch.patches, images, [1], torch.bfloat16)
    assert tokens.shape == (images[1].tokens(cfg.model.vision.encoder.merge), cfg.model.hidden_size)
    # One copy of the patches (into the weights' device and dtype): that image's alone.
    patch_dim = cfg.model.vision.patch_dim
    assert [made for made in copies.made if made[0][-1:] == (patch_dim,)] == [
        ((images[1].patches, patch_dim), torch.bfloat16)]
