"""Invalid layouts failing on every rank before any collective (torchrun end to end:
tests/distributed/test_launch_smoke.py)."""

import os
import re
import subprocess
import sys

import pytest

from launch.local import free_port
from moe_pretrain.config import ConfigError
from parallel.state import resolve_layout
from tests.models import tiny_config

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


@pytest.mark.parametrize(("world", "overrides", "message"), [
    (3, ["parallel.ep=2"], "parallel.ep=2 must divide the 3 ranks of a pipeline stage"),
    (4, ["model.moe.num_experts=6", "model.moe.top_k=2", "parallel.ep=4"],
     "model.moe.num_experts=6 is not divisible by parallel.ep=4"),
    (6, ["parallel.tp=4"], "world size 6 is not divisible by parallel.tp x parallel.pp x parallel.cp = 4 x 1 x 1"),
    (2, ["parallel.tp=2", "model.kda.num_heads=3"], "model.kda.num_heads=3 is not divisible by parallel.tp=2"),
    (8, ["parallel.pp=8", "model.num_layers=6"], "parallel.pp x parallel.vpp = 8 stages for model.num_layers=6"),
    (3, [], "data.batch_size=4 must be divisible by data-parallel size 3"),
    (2, ["parallel.tp=2", "model.vocab_size=265"], "model.vocab_size=265 is not divisible by parallel.tp=2"),
    (2, ["parallel.tp=2", "model.dense_intermediate=47"],
     "model.dense_intermediate=47 is not divisible by parallel.tp=2"),
    (2, ["parallel.tp=2", "data.seq_len=97"], "data.seq_len=97 is not divisible by parallel.tp=2"),
    (2, ["parallel.pp=2", "parallel.pipeline_layers=[2,3]"],
     "parallel.pipeline_layers=[2, 3] must hold 2 counts >= 1 (parallel.pp x parallel.vpp) summing to "
     "model.num_layers=6"),
    (2, ["parallel.pp=2", "parallel.vpp=2"], "parallel.vpp=2 needs parallel.pipeline_schedule=interleaved_1f1b"),
    (2, ["parallel.pp=2", "data.micro_batches=1"], "data.micro_batches=1 must be a multiple of parallel.pp=2"),
    (2, ["parallel.pp=2", "data.micro_batches=2", "model.moe.balancing=aux_loss"],
     "model.moe.balancing=aux_loss is not supported with parallel.pp > 1"),
    (1, ["parallel.cp=1", "parallel.vpp=1"], None),
    (2, ["parallel.cp=2", "data.seq_len=98"],
     "data.seq_len=98 is not divisible by 2 x parallel.cp x parallel.tp = 4 (two fragments per context-parallel"),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_mla=ulysses"],
     "parallel.cp=2 must divide the model.mla.num_heads=2 / parallel.tp=2 attention heads of a tensor-parallel rank "
     "with parallel.cp_mla=ulysses"),
    (4, ["parallel.cp=2", "parallel.tp=2"], None),  # auto: the latent exchange has no head cap
    (4, ["parallel.cp=2", "parallel.ep=2", "data.batch_size=4"], None),
])
def test_layout_errors_name_the_keys(world, overrides, message):
    if message is None:
        resolve_layout(tiny_config(*overrides), world)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_layout(tiny_config(*overrides), world)


def test_valid_folded_layouts():
    layout = resolve_layout(tiny_config("parallel.ep=2", "data.batch_size=8"), 4)
    assert (layout.dp, layout.ep, layout.edp) == (4, 2, 2)
    layout = resolve_layout(tiny_config("parallel.tp=2", "parallel.ep=2"), 2)  # experts over the tp ranks
    assert (layout.dp, layout.tp, layout.ep, layout.edp) == (1, 2, 2, 1)


def test_staged_runs_are_validated_on_their_stage_shapes():
    from tests.models import STAGES

    # data.batch_size is unused under a schedule: it must not be what decides the layout.
    layout = resolve_layout(tiny_config(STAGES, "train.steps=6", "data.batch_size=3"), 2)
    assert layout.dp == 2
    with pytest.raises(ConfigError, match=re.escape("stages[2]: 2 sequences per step must be divisible by "
                                                    "data-parallel size 4 x stages[2].micro_batches=1")):
        resolve_layout(tiny_config(STAGES, "train.steps=6"), 4)
