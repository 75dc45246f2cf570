"""Invalid layouts failing on every rank before any collective (torchrun end to end:
tests/distributed/test_launch_smoke.py)."""

import os
import subprocess
import sys

import pytest

from launch.local import free_port

TINY = ["model.hidden_size=32", "model.num_layers=4", "model.layer_pattern=KKKM", "model.kda.num_heads=2",
        "model.kda.head_dim=8", "model.mla.num_heads=2", "model.moe.num_experts=8", "model.moe.top_k=2",
        "model.moe.expert_intermediate=16", "model.moe.latent_size=16", "data.seq_len=96",
        "data.batch_size=4", "train.steps=3", "logging.progress=false"]


@pytest.mark.timeout(120)
def test_invalid_layout_fails_on_every_rank(tmp_path):
    """The ranks start as torchrun starts them (its environment) but as separate processes: torchrun stops
    the other workers as soon as one exits, so under load a slower rank would be killed before it speaks."""
    port = free_port()
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--config", "configs/smoke.yaml", *TINY, "parallel.ep=3",
         f"train.run_dir={tmp_path / 'bad'}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for rank in (0, 1)]
    for rank, process in enumerate(ranks):
        _, stderr = process.communicate(timeout=100)
        assert process.returncode == 78, stderr[-2000:]  # PERMANENT: a bad config is not retried
        assert f"config error (rank {rank}): invalid parallel layout:" in stderr
        assert "model.moe.num_experts=8 is not divisible by parallel.ep=3" in stderr
    assert not (tmp_path / "bad").exists()






