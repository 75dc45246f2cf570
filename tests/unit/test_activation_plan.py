"""The activation plan (parallel/activation_plan.py) covers the model: each of its rows places at least one module,
and every module whose activations change where they live is placed (the embedding, the image merge, every
sequence mixer, the multi-token-prediction blocks' included), once."""

import re

from moe_pretrain.model.image_merge import ImageMerge
from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.meta import meta_model
from moe_pretrain.model.mla import GatedMLA
from parallel.activation_plan import ACTIVATION_PLAN
from parallel.plan import backbone_path, compile_pattern
from tests.models import tiny_config


def test_every_row_places_a_module_and_every_module_that_moves_activations_is_placed():
    model = meta_model(tiny_config("model.mtp.layers=1").model)
    placed: dict[str, list[str]] = {pattern: [] for pattern, _ in ACTIVATION_PLAN}
    for path, _ in model.named_modules():
        rows = [pattern for pattern, _ in ACTIVATION_PLAN if compile_pattern(pattern).match(backbone_path(path))]
        assert len(rows) <= 1, (path, rows)
        for pattern in rows:
            placed[pattern].append(path)
    assert all(placed.values()), placed
    moving = {path for path, module in model.named_modules()
              if isinstance(module, (KimiDeltaAttention, GatedMLA, ImageMerge)) or path == "embedding"}
    assert moving == {path for paths in placed.values() for path in paths}
    mixers = [path for path in placed["layers.*.mixer"] if re.fullmatch(r"layers\.\d+\.mixer", path)]
    assert len(mixers) == model.cfg.num_layers and len(placed["layers.*.mixer"]) > len(mixers)  # the MTP block's
