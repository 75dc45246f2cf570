"""A short golden loss curve of the smoke model (torchtitan's habit): catches silent numerics changes.

Float64 keeps the curve insensitive to CPU summation order. The corpus is the interpreter's stdlib,
so the curve is tied to the Python version it was recorded with (stored beside it); on another
interpreter the data differ and the test says so instead of comparing. Re-record after an intended
change with: python -m tests.test_golden_loss
"""

import json
import platform
import sys
from pathlib import Path

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.training import Trainer

ASSET = Path(__file__).parent / "assets" / "smoke_losses.json"
OVERRIDES = ["train.steps=6", "train.dtype=float64", "data.batch_size=4", "logging.progress=false"]


def golden_losses(run_dir: Path) -> list[float]:
    cfg = load_config("configs/smoke.yaml", [*OVERRIDES, f"train.run_dir={run_dir}"])
    return [h["loss"] for h in Trainer(cfg).run()]


@pytest.mark.timeout(240)
def test_smoke_loss_curve_matches_golden(tmp_path):
    golden = json.loads(ASSET.read_text())
    if golden["python"] != platform.python_version():
        pytest.skip(f"golden curve recorded on Python {golden['python']}, whose stdlib is the corpus; "
                    f"this is {platform.python_version()}")
    losses = golden_losses(tmp_path / "golden")
    # 1e-6 relative: float64 round-off differences between CPUs stay far below this over 6 steps,
    # while any change to the model, data or optimizer moves the curve by much more.
    assert losses == pytest.approx(golden["losses"], rel=1e-6)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record = {"python": platform.python_version(), "torch": torch.__version__,
                  "overrides": OVERRIDES, "losses": golden_losses(Path(tmp) / "golden")}
    ASSET.parent.mkdir(exist_ok=True)
    ASSET.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2), file=sys.stdout)
