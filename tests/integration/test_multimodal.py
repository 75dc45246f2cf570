"""The model reads images: after training on captioned synthetic images it names the colour of a held-out
image's shape far better than chance, and only when it sees that image.

Every colour word starts with a different letter (r, g, b, y, m, c, w), so the byte after "a " in a caption
can be predicted well only from the patches: with another image's patches, accuracy falls to chance.
"""

import numpy as np
import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.data import tokenizer as tok
from moe_pretrain.data.embedded import to_pixels
from moe_pretrain.data.patches import PlacedImage, expand_images
from moe_pretrain.data.synthetic_images import COLOURS, make_image
from moe_pretrain.data.vocabulary import BYTES
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import EVAL_OFF

HELD_OUT_SEED = 999  # training uses data.seed (1234): these images were never seen


def held_out_document(index: int, image_index: int, cfg) -> tuple[np.ndarray, np.ndarray, list, int]:
    """(tokens, patches, grids, position of the colour byte) as the training data reads them: stored as uint8,
    the image's tokens in place; the caption of image `index`, the pixels of image `image_index`."""
    _, caption = make_image(HELD_OUT_SEED, index, cfg.data.image_size)
    image, _ = make_image(HELD_OUT_SEED, image_index, cfg.data.image_size)
    body = np.array([tok.BOS, tok.IMAGE_START, tok.IMAGE_END, *tok.encode(caption), tok.EOS])
    vision = cfg.model.vision
    tokens, patches, grids = expand_images(body, [to_pixels(image)], BYTES, vision.patch_size, vision.encoder.merge)
    colour_at = int(np.flatnonzero(tokens == tok.IMAGE_END)[0]) + 3  # IMAGE_END, "a", " ", colour
    return tokens, patches, grids, colour_at


def colour_accuracy(model, cfg, wrong_images: bool, n: int = 140) -> float:
    """Share of held-out captions whose colour byte is the model's top prediction; wrong_images: each caption
    after another image (of its own size), so only looking at the right image helps."""
    docs = [held_out_document(i, (i + 1) % n if wrong_images else i, cfg) for i in range(n)]
    width = max(len(d[0]) for d in docs)
    tokens = torch.full((n, width), tok.PAD, dtype=torch.int64)
    for row, (doc_tokens, *_) in enumerate(docs):
        tokens[row, :len(doc_tokens)] = torch.from_numpy(doc_tokens)
    colour_at = torch.tensor([d[3] for d in docs])
    rows = torch.arange(n)
    assert all(bytes(tokens[r, c - 2:c].tolist()) == b"a " for r, c in enumerate(colour_at.tolist()))
    assert len({tuple(d[2][0]) for d in docs}) == 4  # images of four sizes and three aspect ratios
    # Each row: BOS, IMAGE_START, then the image's tokens from position 2.
    images = [PlacedImage(row, 2, d[2][0]) for row, d in enumerate(docs)]
    model.eval()
    with torch.no_grad():
        logits, _ = model(tokens, None, torch.from_numpy(np.concatenate([d[1] for d in docs])),
                          tokens == tok.IMAGE_PATCH, images)
    return float((logits[rows, colour_at - 1].argmax(-1) == tokens[rows, colour_at]).float().mean())


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 min on an idle 2-core machine; a CI machine shared with other jobs is far slower
def test_caption_colour_is_predicted_from_the_image(tmp_path):
    assert len({name[0] for name in COLOURS}) == len(COLOURS)  # first letters identify the colour
    cfg = load_config("configs/smoke.yaml", [
        "train.steps=400", "optim.lr=6e-3", "data.image_fraction=1.0",
        "data.image_size=112", "data.seq_len=128", "data.batch_size=8", "model.hidden_size=64", "model.num_layers=4",
        "model.layer_pattern=KKKM", "model.kda.head_dim=32", "model.moe.latent_size=32", "model.dense_intermediate=128",
        "model.moe.expert_intermediate=32", "model.moe.shared_intermediate=32", "optim.warmup_steps=10",
        "logging.progress=false", f"train.run_dir={tmp_path}", *EVAL_OFF])
    trainer = Trainer(cfg)
    run_training(trainer)
    seen = colour_accuracy(trainer.model, cfg, wrong_images=False)
    wrong = colour_accuracy(trainer.model, cfg, wrong_images=True)
    chance = 1 / len(COLOURS)
    # Images of four sizes (112 x 112, 112 x 56, 56 x 112, 56 x 56: 16, 8, 8 and 4 tokens) through the smoke
    # config's tower (2 blocks of width 32), trained from scratch with the model at the full rate. Measured
    # (train.seed 0 / 1234): 0.99 / 1.00 with the image, 0.13 / 0.13 with another image's (chance 0.14); 0.77 at
    # 200 steps, 0.95 at 300. The linear patch embedding the tower replaced (one Linear per 14 x 14 patch, 28 x
    # 28 images, 4 tokens each, one per quadrant) reached 0.99 at 200 steps and 1.00 at 400; the tower on images
    # of that geometry (56 x 56 only, 4 merged tokens each) 0.98 at 200 steps and 1.00 at 400. The
    # linear embedding's own test asked for 0.5 (it measured 0.85 at 200 steps on the dark canvas of the time).
    assert seen >= 0.9, (seen, wrong)
    assert wrong <= chance + 0.1, (seen, wrong)
    assert seen - wrong >= 0.75, (seen, wrong)
