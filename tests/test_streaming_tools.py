"""Tools on a probe checkpoint hold a tensor, a file or a rank's shard at a time, never the model: export's peak
memory is bounded by its output file size, reshard's by each target rank's share of the state."""

import json
import subprocess
import sys

import pytest

from moe_pretrain.config import load_config
from moe_pretrain.training import Trainer
from moe_pretrain.training.reshard import reshard

PROBE = "configs/probe_memory.yaml"
SMALL = ["model.moe.num_experts=16", "model.moe.expert_intermediate=512", "model.moe.latent_size=256"]
"""44M parameters: 176 MB of fp32 weights, the largest tensor 8 MB (an expert stack)."""
MODEL_BYTES = 176e6

EXPORT_PEAK = """
import json, sys
from pathlib import Path
from moe_pretrain.checkpoint.export import export
from moe_pretrain.memory import peak_resident_bytes, reset_peak, resident_bytes
before = resident_bytes()
reset_peak()
files = export(Path(sys.argv[1]), Path(sys.argv[2]), max_shard_bytes=16 << 20)
print(json.dumps({"extra": peak_resident_bytes() - before, "files": len(files)}))
"""


@pytest.fixture(scope="module")
def probe_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("probe")
    cfg = load_config(PROBE, [*SMALL, "train.steps=1", f"train.run_dir={run}"])
    Trainer(cfg).run()
    return run / "checkpoints" / "step_00000001"


@pytest.mark.timeout(300)
def test_export_streams_one_file_at_a_time(probe_checkpoint, tmp_path):
    done = subprocess.run([sys.executable, "-c", EXPORT_PEAK, str(probe_checkpoint), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["files"] >= 10  # 16 MB files out of 176 MB
    # One 16 MB file in memory while it is written (plus DCP's read buffers): 64 MB bounds it with room
    # for the allocator, and is far below the 176 MB a whole-model export held.
    assert result["extra"] < 64e6, result


@pytest.mark.timeout(300)
def test_reshard_holds_each_rank_share_only(probe_checkpoint, tmp_path):
    result = reshard(probe_checkpoint, tmp_path / "pp2xep2", 4, ["parallel.pp=2", "parallel.ep=2"])
    assert result.path.name == "step_00000001" and (result.path / "manifest.json").is_file()
    # Rank 0 holds about a quarter of the parameters and their moments (12 B each, no gradients): its peak
    # stays within 1.3x that share (plus 50 MB for the interpreter's and DCP's own buffers) and far below
    # the whole state (3 x 176 MB).
    assert result.state_bytes < 0.35 * 3 * MODEL_BYTES
    assert result.peak_bytes < 1.3 * result.state_bytes + 50e6, result
