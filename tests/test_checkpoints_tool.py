"""python -m checkpoints_tool inspect | verify | prune on real checkpoints."""

import subprocess
import sys

import pytest

from moe_pretrain.checkpoint import committed_checkpoints
from moe_pretrain.sizing import count
from moe_pretrain.training import Trainer
from tests.models import tiny_config


def tool(*args):
    return subprocess.run([sys.executable, "-m", "checkpoints_tool", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def checkpoints(tmp_path):
    cfg = tiny_config("train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=4", f"train.run_dir={tmp_path}",
                      "logging.progress=false")
    Trainer(cfg).run()
    return tmp_path / "checkpoints", cfg


def test_inspect_reports_step_layout_and_parameters(checkpoints):
    root, cfg = checkpoints
    done = tool("inspect", root)
    assert done.returncode == 0, done.stderr
    assert "step        4" in done.stdout and "dp 1 x tp 1 x pp 1 x cp 1; ep 1" in done.stdout
    assert f"parameters  {count(cfg.model, cfg.data.seq_len)['total_params']:,}" in done.stdout
    assert "model.layers.*.mlp.experts" in done.stdout and ".metadata" in done.stdout


def test_verify_exit_codes_name_bad_files(checkpoints):
    root, _ = checkpoints
    assert tool("verify", root).returncode == 0
    shard = root / "step_00000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = tool("verify", root)
    assert done.returncode == 1
    assert "BAD" in done.stdout and "step_00000003/__0_0.distcp: sha256" in done.stdout
    assert tool("verify", root / "step_00000004").returncode == 0
    assert tool("verify", root / "nowhere").returncode == 2


def test_prune_never_touches_latest(checkpoints):
    root, _ = checkpoints
    (root / "latest").write_text("step_00000001\n")  # pretend an operator pointed latest at an old one
    done = tool("prune", root, "--keep-last", 1)
    assert done.returncode == 0, done.stderr
    assert [step for step, _ in committed_checkpoints(root)] == [4, 1]
