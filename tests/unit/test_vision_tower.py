"""The MoonViT-style vision tower and projector (model/vision_tower.py): the released sizes, images attended only
within themselves when packed, 2-D rotary positions that depend on offsets only, the merge order, and training in
bf16.

Tolerances: packed against one image at a time in float64 within 1e-12 (the same operations on other rows);
rotary scores for equal offsets within 1e-12 (float64)."""

import pytest
import torch

from moe_pretrain.config import VisionEncoderConfig
from moe_pretrain.model.counts import vision_projector_params, vision_tower_params
from moe_pretrain.model.init import initialize
from moe_pretrain.model.vision_positions import apply_rope, resized_table, rope_angles
from moe_pretrain.model.vision_tower import VisionProjector, VisionTower, merge_patches

TINY = VisionEncoderConfig(num_layers=2, hidden_size=32, num_heads=2, head_dim=16, intermediate_size=64, pos_grid=8)
GRIDS = [(1, 4, 6), (2, 2, 2), (1, 6, 4)]
PATCH_DIM = 3 * 14 * 14


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_size_tower_and_projector_have_the_released_parameter_counts():
    """The release's vision_tower.* and mm_projector.* (hidden 7168): 401,214,464 and 46,144,512 parameters; the
    sizing counter's formulas give the built modules' counts."""
    full = VisionEncoderConfig()
    with torch.device("meta"):
        tower, projector = VisionTower(full, 14, 3, 0.02), VisionProjector(full.merged_size, 7168, 1e-6, 0.02)
    assert numel(tower) == vision_tower_params(full, 14, 3) == 401_214_464
    assert numel(projector) == vision_projector_params(full, 7168) == 46_144_512
    names = {name for name, _ in tower.named_parameters()}
    assert {"patch_embed.proj.weight", "patch_embed.pos_emb.weight", "encoder.blocks.26.wqkv.weight",
            "encoder.blocks.0.mlp.fc1.weight", "encoder.final_layernorm.weight"} <= names
    assert tower.patch_embed.proj.weight.shape == (1024, 3, 14, 14)
    assert tower.encoder.blocks[0].wqkv.weight.shape == (4608, 1024)


def test_packed_images_attend_only_within_themselves():
    """Three images of different grids (one a 2-frame clip) in one call give what each gives alone."""
    tower = initialize(VisionTower(TINY, 14, 3, 0.02), 0).double()
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), PATCH_DIM, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    packed = tower(patches, GRIDS)
    alone, start = [], 0
    for grid in GRIDS:
        size = grid[0] * grid[1] * grid[2]
        alone.append(tower(patches[start:start + size], [grid]))
        start += size
    assert packed.shape == (6 + 1 + 6, 4 * TINY.hidden_size)  # (h/2)(w/2) merged tokens per image
    assert (packed - torch.cat(alone)).abs().max() < 1e-12


def test_rotary_scores_depend_only_on_the_offset_between_patches():
    gen = torch.Generator().manual_seed(2)
    angles = rope_angles(1, 5, 7, 16, 1e4, torch.device("cpu"))
    q, k = (torch.randn(1, 1, 16, dtype=torch.float64, generator=gen).expand(35, 1, 16) for _ in range(2))
    rq, rk = apply_rope(q, angles), apply_rope(k, angles)

    def score(a: tuple[int, int], b: tuple[int, int]) -> float:
        return (rq[a[0] * 7 + a[1]] * rk[b[0] * 7 + b[1]]).sum().item()
    assert abs(score((0, 0), (1, 2)) - score((3, 4), (4, 6))) < 1e-12
    assert abs(score((2, 1), (0, 0)) - score((4, 5), (2, 4))) < 1e-12
    assert abs(score((0, 0), (1, 2)) - score((0, 0), (2, 1))) > 1e-6  # rows and columns turn apart


def test_position_table_resizes_and_patches_merge_in_row_major_blocks():
    table = torch.randn(8, 8, 4)
    assert torch.equal(resized_table(table, 8, 8, "bilinear"), table.flatten(0, 1))
    assert torch.allclose(resized_table(torch.ones(8, 8, 4), 3, 5, "bilinear"), torch.ones(15, 4))
    x = torch.arange(2 * 4 * 4, dtype=torch.float64).unsqueeze(1)  # a 2-frame 4 x 4 clip, feature = row index
    merged = merge_patches(x, [(2, 4, 4)], 2)
    assert merged.shape == (4, 4)
    # block (0, 0): patches 0, 1, 4, 5 of frame 0 and 16, 17, 20, 21 of frame 1, averaged over the frames
    assert merged[0].tolist() == [8.0, 9.0, 12.0, 13.0]
    assert merged[3].tolist() == [18.0, 19.0, 22.0, 23.0]


def test_the_tower_trains_in_bf16_autocast_and_refuses_bad_grids():
    tower = initialize(VisionTower(TINY, 14, 3, 0.02), 0)
    projector = initialize(VisionProjector(TINY.merged_size, 48, 1e-6, 0.02), 0)
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), PATCH_DIM, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = projector(tower(patches, GRIDS))
    assert out.shape == (13, 48) and out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    for name, p in [*tower.named_parameters(), *projector.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="cover 24 patches, not the 25"):
        tower(torch.randn(25, PATCH_DIM), [(1, 4, 6)])
    with pytest.raises(ValueError, match=r"grid \(1, 3, 6\) needs h and w in multiples of model.vision.encoder.merge"):
        tower(torch.randn(18, PATCH_DIM), [(1, 3, 6)])


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_memory_plan_counts_the_towers_saved_activations(recompute):
    """planning.step_activations.vision_activations against the live tensor bytes a forward keeps for backward
    (measured.LiveTensorBytes: exact on every machine), the patches copied in included (as the model copies a
    rank's images in: MoETransformer.encode_images), for two tower shapes and a batch with a clip, fp32:
    within 1% without recomputation (a fit over nine shapes, every residual under one element per patch); with
    full recomputation at most 5% over (measured 4%: the part outside the blocks is rounded up)."""
    from moe_pretrain.config import load_config
    from moe_pretrain.planning.measured import LiveTensorBytes
    from moe_pretrain.planning.step_activations import vision_activations

    for encoder in (TINY, VisionEncoderConfig(num_layers=3, hidden_size=48, num_heads=3, head_dim=16,
                                              intermediate_size=96, pos_grid=8)):
        cfg = load_config("configs/smoke.yaml", ["model.hidden_size=96"]).model
        cfg.vision.encoder = encoder
        tower = VisionTower(encoder, 14, 3, 0.02)
        tower.encoder.recompute = recompute == "full"
        projector = VisionProjector(encoder.merged_size, cfg.hidden_size, 1e-6, 0.02)
        initialize(tower, seed=0)
        initialize(projector, seed=1)
        patches = sum(t * h * w for t, h, w in GRIDS)
        on_host = torch.randn(patches, PATCH_DIM)
        with LiveTensorBytes() as live:
            out = projector(tower(on_host.clone(), GRIDS))
            saved = live.live - out.numel() * out.element_size()
        planned, _ = vision_activations(cfg, recompute)
        measured = saved / 4 / patches
        if recompute == "none":
            assert measured == pytest.approx(planned, rel=0.01), encoder
        else:
            assert measured <= planned <= 1.05 * measured, (encoder, measured, planned)
        out.sum().backward()
