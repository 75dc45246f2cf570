"""What every command shares: how it takes a config, how a bad one fails, how it logs, which device one
process uses, and what it derives when a key is left unset."""

import json
import logging
import subprocess
import sys

import pytest
import torch

from launch import plan, train
from moe_pretrain.config import EX_CONFIG, ConfigError, load_config
from moe_pretrain.log import LEVEL_ENV, PACKAGES, setup_logging
from moe_pretrain.planning import sizing
from parallel.state import init_parallel
from tests.models import TINY

PY = sys.executable


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", *args], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture
def restore_logging():
    """setup_logging binds handlers to this test's captured streams: undo it, so later tests log as before."""
    yield
    for package in PACKAGES:
        logger = logging.getLogger(package)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def output_of(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command's main(argv), in this process."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_every_config_command_takes_positional_and_repeated_configs(capsys, restore_logging):
    """sizing, plan and train: CONFIG positionally or with --config, layered files, trailing overrides."""
    code, positional, _ = output_of(sizing.main, ["configs/full.yaml", "--json"], capsys)
    assert code == 0
    assert json.loads(positional) == json.loads(output_of(sizing.main, ["--config", "configs/full.yaml", "--json"],
                                                          capsys)[1])
    overridden = output_of(sizing.main, ["--json", "--config", "configs/full.yaml", "model.moe.num_experts=448"],
                           capsys)[1]
    assert json.loads(overridden)["total_params"] < json.loads(positional)["total_params"]
    code, plan_positional, _ = output_of(plan.main, ["configs/full.yaml", "--config", "configs/stages/full.yaml"],
                                         capsys)
    assert code == 0 and "231250" in plan_positional
    assert plan_positional == output_of(plan.main, ["--config", "configs/full.yaml", "--config",
                                                    "configs/stages/full.yaml"], capsys)[1]
    for main in (sizing.main, plan.main, train.main):
        code, _, err = output_of(main, [], capsys)
        assert code == EX_CONFIG and "no config file given" in err, main.__module__


BAD_YAML = "model:\n  hidden_size: 64\n  num_layers: [1, 2\ntrain:\n  steps: 3\n"


@pytest.mark.timeout(120)
def test_malformed_yaml_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    with pytest.raises(ConfigError, match=rf"config file {bad}, line 4, column 6: not valid YAML"):
        load_config(bad)
    for command in ("launch.train", "moe_pretrain.planning.sizing"):
        done = run(command, "--config", str(bad))
        assert done.returncode == EX_CONFIG, command
        assert f"{bad}, line 4, column 6" in done.stderr and "Traceback" not in done.stderr


def test_log_lines_carry_time_and_rank_and_other_ranks_only_warn(capsys, monkeypatch, restore_logging):
    log = logging.getLogger("moe_pretrain.test")
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    setup_logging(rank=0)
    log.info("hello")
    log.debug("hidden")
    setup_logging(rank=3)
    log.info("rank 3 info is dropped")
    log.warning("rank 3 warns")
    out, err = capsys.readouterr()
    assert "[rank 0] INFO hello" in out and out[:4].isdigit() and "hidden" not in out
    assert "rank 3 info" not in out + err and "[rank 3] WARNING rank 3 warns" in err
    setup_logging(rank=3, all_ranks=True)
    log.info("now every rank")
    monkeypatch.setenv(LEVEL_ENV, "debug")  # the environment wins over logging.level
    setup_logging(rank=0, level="warning")
    log.debug("debugging")
    out, _ = capsys.readouterr()
    assert "[rank 3] INFO now every rank" in out and "[rank 0] DEBUG debugging" in out
    monkeypatch.setenv(LEVEL_ENV, "loud")
    with pytest.raises(ConfigError, match=LEVEL_ENV):
        setup_logging(rank=0)


def test_one_process_uses_the_same_device_rule_as_many(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_parallel(load_config("configs/smoke.yaml", TINY)).device == torch.device("cpu")  # no CUDA here
    # On a machine with a GPU (simulated): CUDA, like every rank of a torchrun job...
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    ctx = init_parallel(load_config("configs/smoke.yaml", TINY))
    assert ctx.device == torch.device("cuda:0") and chosen == [torch.device("cuda:0")]
    # ...unless parallel.backend=gloo forces the CPU.
    assert init_parallel(load_config("configs/smoke.yaml", [*TINY, "parallel.backend=gloo"])).device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel\.backend=nccl needs CUDA"):
        init_parallel(load_config("configs/smoke.yaml", [*TINY, "parallel.backend=nccl"]))






