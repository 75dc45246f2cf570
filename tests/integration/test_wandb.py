"""Weights & Biases logging in offline mode (no network): the step scalars reach the run's file, and a
resumed run continues the same W&B run id."""

import json
from pathlib import Path

import pytest

from moe_pretrain.config import ConfigError
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.operations.wandb_run import RUN_ID_FILE
from moe_pretrain.training import Trainer
from tests.models import tiny_config

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb is part of the test extra")
wandb = pytest.importorskip("wandb")


def wandb_records(path: Path):
    """The protobuf records of an offline run file (a LevelDB-style log: 32 KiB blocks, 7-byte headers; a
    zero-filled header is padding up to the next block, as LevelDB's own reader skips it)."""
    data, pos, block, partial = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zeros (LevelDB's "zero type": a preallocated, not yet written region): the next block
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(partial)
            yield record


def history(run_file: Path) -> tuple[str, list[dict]]:
    run_id, rows = "", []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = run_id or record.run.run_id
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return run_id, rows


def test_offline_wandb_gets_the_step_scalars_and_a_resume_keeps_the_run(tmp_path):
    overrides = ("logging.wandb.project=moe-test", "logging.wandb.mode=offline", "logging.progress=false",
                 "checkpoint.every=2", f"train.run_dir={tmp_path}", "train.steps=4")
    first = run_training(Trainer(tiny_config(*overrides, "train.exit_at_step=2")))
    second = run_training(Trainer(tiny_config(*overrides)))
    # run.finish() returns before W&B's service process has written the whole file; its teardown waits for that
    # process to end (as the atexit hook of a training process does)
    wandb.teardown()
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # one W&B run, resumed
    logged = []
    for file in files:
        found_id, rows = history(file)
        assert found_id == run_id
        logged += rows
    assert [row["_step"] for row in logged] == [1, 2, 3, 4]
    assert [row["loss"] for row in logged] == pytest.approx([h["loss"] for h in first + second], rel=1e-6)
    assert "moe/2/router_entropy" in logged[0]


def test_wandb_without_the_package_stops_at_start(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError, match=r"logging\.wandb\.project='p' needs the wandb package"):
        run_training(Trainer(tiny_config("logging.wandb.project=p", f"train.run_dir={tmp_path}")))
    assert not any(tmp_path.iterdir())  # refused before the run wrote anything
