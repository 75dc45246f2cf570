"""A short golden loss curve of the smoke model (torchtitan's habit): catches silent numerics changes.

The data are fixed, whatever the interpreter: text from a frozen snapshot of the project's design notes
(tests/assets/golden_corpus.jsonl, preprocessed with the byte tokenizer) blended with the procedural
images of the embedded corpus (numpy-seeded, not the stdlib). So the curve holds across Python patch
versions, where the embedded stdlib text would change. Float64 keeps it insensitive to CPU summation
order and thread counts. Re-record after an intended change with: python -m tests.integration.test_golden_loss
"""

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.data.embedded import synthetic_image_dataset
from moe_pretrain.data.preprocess import preprocess
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import EVAL_OFF

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
ASSETS = Path(__file__).parents[1] / "assets"
GOLDEN = ASSETS / "smoke_losses.json"
CORPUS = ASSETS / "golden_corpus.jsonl"
# The exact quantile balancing, the reference the curve was recorded with (the default's histograms are held
# to it by tests/unit/test_quantile_histogram.py).
OVERRIDES = ["train.steps=6", "train.dtype=float64", "data.batch_size=4", "logging.progress=false",
             "model.moe.qb_quantile=exact", *EVAL_OFF]


def golden_losses(work: Path) -> list[float]:
    """Both datasets are built in `work` and named relative to it: a blend seeds each dataset's document
    order with its path, which must not depend on where the test's temporary folder is."""
    base = load_config(SMOKE, [*OVERRIDES, f"data.cache_dir={work}"])
    preprocess([CORPUS], work / "golden-text", progress=False)
    images = synthetic_image_dataset(base.data, base.model.vision.channels).name
    blend = f"data.blend=[{{path: golden-text, weight: 0.9}}, {{path: {images}, weight: 0.1}}]"
    cfg = load_config(SMOKE, [*OVERRIDES, blend, "train.run_dir=run"])
    with contextlib.chdir(work):
        return [h["loss"] for h in run_training(Trainer(cfg))]


@pytest.mark.timeout(240)
def test_smoke_loss_curve_matches_golden(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    losses = golden_losses(tmp_path)
    # 1e-6 relative: float64 round-off differences between CPUs, thread counts and Python patch versions
    # stay far below this over 6 steps, while any change to the model, data or optimizer moves the curve
    # by much more.
    assert losses == pytest.approx(golden["losses"], rel=1e-6), (
        f"the golden curve (recorded with torch {golden['torch']}) moved; if the change is intended, "
        "re-record it with python -m tests.integration.test_golden_loss and say so in the commit")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record = {"torch": torch.__version__, "overrides": OVERRIDES, "corpus": CORPUS.name,
                  "losses": golden_losses(Path(tmp))}
    GOLDEN.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2), file=sys.stdout)
