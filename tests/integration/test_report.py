"""Observability outputs: TensorBoard event files with the metrics' scalars, and launch.report's PNGs."""

import json

import pytest

from launch.report import main as report_main
from launch.report import read_metrics, stage_boundaries
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGES = ("stages=[{name: short, tokens: 768, seq_len: 96, batch_tokens: 384}, "
          "{name: long, tokens: 768, seq_len: 192, batch_tokens: 384}]")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    run_training(Trainer(tiny_config(STAGES, "train.steps=4", "logging.expert_load_every=3",
                                     "logging.progress=false", "eval.tokens=200", f"train.run_dir={run_dir}")))
    return run_dir


def test_tensorboard_events_hold_the_step_scalars(run_dir):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is part of the test extra")
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    names = events.Tags()["scalars"]
    expected = {"loss", "lr", "tokens_per_s", "mfu", "seq_len", "moe/2/router_entropy", "moe/2/tokens_dropped",
                "eval_loss", "data_wait_s"}
    assert expected <= set(names)
    assert [e.step for e in events.Scalars("eval_loss")] == [2, 4]  # the ends of the two stages
    metrics = read_metrics(run_dir)
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in metrics], rel=1e-6)


def test_report_writes_plots_with_stage_boundaries_and_load_heatmaps(run_dir, capsys):
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics if "load" in r["moe"]["2"]] == [1, 3, 4]  # step 1, every 3, the last
    assert len(metrics[0]["moe"]["2"]["load"]) == 8
    assert stage_boundaries(metrics) == [(768, "long")]
    assert report_main([str(run_dir)]) == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in written] == ["loss_lr.png", "throughput.png", "position_loss.png",
                                                     "retrieval.png", "expert_load_step1.png",
                                                     "expert_load_step3.png", "expert_load_step4.png"]
    for path in written:
        data = open(path, "rb").read()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path
    assert report_main([str(run_dir), "--steps", "2", "--out", str(run_dir / "other")]) == 1
    assert "steps [2] have no per-expert loads" in capsys.readouterr().err


def test_report_keeps_the_later_record_of_a_repeated_step(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [r["loss"] for r in read_metrics(tmp_path)] == [3.0, 1.5]
    assert report_main([str(tmp_path / "missing")]) == 1
