"""python -m checkpoints_tool inspect | verify | prune on real checkpoints."""

import subprocess
import sys

import pytest

from moe_pretrain.checkpoint import committed_checkpoints
from moe_pretrain.model.counts import count
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.checkpoints_cli import tool
from tests.models import tiny_config


@pytest.fixture
def checkpoints(tmp_path):
    cfg = tiny_config("train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=4", f"train.run_dir={tmp_path}",
                      "logging.progress=false")
    run_training(Trainer(cfg))
    return tmp_path / "checkpoints", cfg


def test_inspect_reports_step_layout_and_parameters(checkpoints):
    root, cfg = checkpoints
    done = tool("inspect", root)
    assert done.returncode == 0, done.stderr
    assert "step        4" in done.stdout and "dp 1 x tp 1 x pp 1 x cp 1; ep 1" in done.stdout
    assert f"parameters  {count(cfg.model, cfg.data.seq_len)['total_params']:,}" in done.stdout
    assert "model.layers.*.mlp.experts" in done.stdout and ".metadata" in done.stdout


def test_inspect_of_a_root_whose_latest_did_not_commit_names_the_intact_older_one(checkpoints):
    root, _ = checkpoints
    (root / "step_00000004" / "manifest.json").unlink()
    done = tool("inspect", root)
    assert done.returncode == 2
    assert f"the newest checkpoint with a manifest is {root / 'step_00000003'}" in done.stderr


def test_a_root_whose_latest_was_deleted_is_a_root_as_training_takes_it(checkpoints):
    """Training resumes from such a root (the newest checkpoint that verifies); verify and inspect agree."""
    root, _ = checkpoints
    (root / "latest").unlink()
    done = tool("verify", root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[1:]] == ["OK"] * 4, done.stdout
    assert "has no `latest`: verifying every checkpoint" in done.stdout.splitlines()[0]
    done = tool("inspect", root)
    assert done.returncode == 0 and "step        4" in done.stdout, done.stderr
    assert f"taking the newest committed checkpoint, {root / 'step_00000004'}" in done.stderr


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
    command = subprocess.run([sys.executable, "-m", "checkpoints_tool", "verify", str(root / "nowhere")],
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 2 and "nowhere" in command.stderr, command.stderr


def test_prune_never_touches_latest(checkpoints):
    root, _ = checkpoints
    (root / "latest").write_text("step_00000001\n")  # pretend an operator pointed latest at an old one
    done = tool("prune", root, "--keep-last", 1, "--force")
    assert done.returncode == 0, done.stderr
    assert [step for step, _ in committed_checkpoints(root)] == [4, 1]


def test_prune_keeps_the_newest_checkpoint_that_verifies(checkpoints):
    """The issue's fault: an intact step_3 and a truncated step_4 (`latest`); prune --keep-last 1 deleted step_3
    and exited 0, leaving nothing that loads."""
    root, _ = checkpoints
    shard = root / "step_00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    refused = tool("prune", root, "--keep-last", 1)
    assert refused.returncode == 2 and "pass --force" in refused.stderr and "keep_last < 2" in refused.stderr
    done = tool("prune", root, "--keep-last", 1, "--force")
    assert done.returncode == 0, done.stderr
    assert f"kept {root / 'step_00000004'}: it does not verify" in done.stdout
    assert [step for step, _ in committed_checkpoints(root)] == [4, 3]  # the damaged one and the newest good one
    shard = root / "step_00000003" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    none_good = tool("prune", root, "--keep-last", 2)
    assert none_good.returncode == 1 and "nothing deleted" in none_good.stderr
    assert [step for step, _ in committed_checkpoints(root)] == [4, 3]


def tp_ep_worker(rank, world_size, run_dir):
    from parallel.parallelize import gather_full_state
    from parallel.state import destroy_parallel, init_parallel

    cfg = tiny_config("train.steps=2", "parallel.tp=2", "parallel.ep=2", f"train.run_dir={run_dir}",
                      "logging.progress=false")
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        run_training(trainer)
        return gather_full_state(trainer.model, ctx)
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_export_consolidates_a_sharded_checkpoint(tmp_path):
    import json

    from safetensors import safe_open

    from launch.local import run_distributed

    full = run_distributed(tp_ep_worker, 2, str(tmp_path / "run"))
    done = tool("export", tmp_path / "run" / "checkpoints", tmp_path / "export", "--max-shard-mb", 0.2)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    exported = {}
    for file in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "export" / file), framework="pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
    assert exported.keys() == full.keys()
    for name, tensor in full.items():
        assert exported[name].equal(tensor), name  # tensor-, expert-parallel shards put back whole
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["moe"]["num_routed_experts"] == 8 and config["layer_types"][2] == "mla"
    assert tool("export", tmp_path / "run" / "checkpoints", tmp_path / "export").returncode == 2  # no overwrite


@pytest.mark.timeout(300)
def test_reshard_keeps_every_value(checkpoints, tmp_path):
    from safetensors import safe_open

    root, _ = checkpoints
    done = tool("reshard", root, tmp_path / "resharded", "--tp", 2, "--ep", 2)
    assert done.returncode == 0, done.stderr
    assert "dp 1 x tp 2" in tool("inspect", tmp_path / "resharded").stdout
    for source, out in ((root, "a"), (tmp_path / "resharded", "b")):
        assert tool("export", source, tmp_path / out).returncode == 0

    def read(directory):
        tensors = {}
        for file in directory.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        return tensors

    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_every_command_on_a_directory_that_is_no_checkpoint_says_so_in_one_line(tmp_path, capsys):
    """In process (no interpreter start per command): one line on stderr naming the path, exit 2, no traceback."""
    from checkpoints_tool.__main__ import main

    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    commands = {
        "inspect": ["inspect", empty],
        "export": ["export", empty, tmp_path / "out"],
        "reshard": ["reshard", empty, tmp_path / "out"],
        "prune": ["prune", empty, "--keep-last", "2"],
        "import": ["import", empty, tmp_path / "out", "--config", "configs/smoke.yaml"],
        "missing": ["inspect", tmp_path / "nowhere"],
    }
    for name, argv in commands.items():
        assert main([str(a) for a in argv]) == 2, name
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(argv[1]) in err and "Traceback" not in err, (name, err)
    assert main(["verify", str(empty)]) == 1  # verify reports what is missing, as for a half-written save
    assert "manifest.json: missing (the save never committed)" in capsys.readouterr().out
