"""Validation in one process: held-out documents never drawn for training, and the evaluations equal to their direct
computation, run at the stage ends."""

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from launch.evaluate import main as evaluate_main
from moe_pretrain.config import config_to_dict
from moe_pretrain.data import IGNORE_INDEX, PretrainingData
from moe_pretrain.data.long_context_eval import long_document_rows, position_edges, probe_batches, probe_tokenizer
from moe_pretrain.data.patches import placed_images
from moe_pretrain.data.validation import ValidationData
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import EVAL, STAGES, tiny_config


def test_held_out_documents_are_never_drawn_for_training():
    cfg = tiny_config(*EVAL, "data.image_fraction=0.3")
    data = PretrainingData(cfg)
    held = {(path, int(r)) for path, records in data.held_out.items() for r in records}
    assert len(data.held_out) == 2 and all(len(r) > 0 for r in data.held_out.values())  # text and images
    drawn = {data._next_document().origin for _ in range(3000)}
    assert drawn and not drawn & held
    again = PretrainingData(cfg)  # the rule is a pure function of the dataset name, count, share and seed
    assert all(torch.equal(torch.from_numpy(again.held_out[p]), torch.from_numpy(r)) for p, r in data.held_out.items())
    names = [v.name for v in ValidationData(data).sets]
    assert len(names) == 2 and all(not name.startswith("/") for name in names)


def direct_eval_loss(trainer: Trainer, seq_len: int) -> dict[str, float]:
    """Every validation row through the model at once, one cross-entropy per dataset (float64)."""
    out, total = {}, [0.0, 0]
    for name, batches in trainer.validation.batches(seq_len, 0, 1, 10_000).items():
        (batch,) = batches
        with torch.no_grad():
            logits, _ = trainer.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum").item()
        count = int((batch.labels != IGNORE_INDEX).sum())
        out[f"eval_loss.{name}"] = ce / count
        total = [total[0] + ce, total[1] + count]
    out["eval_loss"] = total[0] / total[1]
    return out


def direct_long_context(trainer: Trainer, seq_len: int) -> dict[str, float]:
    """Loss by position bucket and probe accuracy straight from the logits of one process (float64)."""
    data, cfg = trainer.data, trainer.cfg.eval
    batch = data.read_rows(long_document_rows(data, trainer.validation.sets, seq_len, cfg.long_documents))
    with torch.no_grad():
        logits, _ = trainer.model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask,
                              placed_images(batch.grids, batch.starts))
    per_token = F.cross_entropy(logits.transpose(1, 2), batch.labels, ignore_index=IGNORE_INDEX, reduction="none")
    scored = batch.labels != IGNORE_INDEX
    out = {}
    edges = position_edges(seq_len, cfg.position_base)
    for lo, hi in itertools.pairwise(edges):
        out[f"eval_position_loss.{lo}-{hi}"] = (per_token[:, lo:hi].sum() / scored[:, lo:hi].sum()).item()
    cells = probe_batches(data.vocabulary, probe_tokenizer(data.vocabulary), seq_len, cfg.probe_samples,
                          cfg.probe_samples, 0, 0, 1, data.patch_dim)
    right = keys = 0
    for name, cell in cells.items():
        with torch.no_grad():
            logits, _ = trainer.model(cell.tokens, cell.doc_ids, cell.patches, cell.image_mask,
                              placed_images(cell.grids, cell.starts))
        where = cell.labels != IGNORE_INDEX
        hits = int((logits.argmax(-1)[where] == cell.labels[where]).sum())
        out[f"probe_accuracy.{name}"] = hits / int(where.sum())
        right, keys = right + hits, keys + int(where.sum())
    out["probe_accuracy"] = right / keys
    return out


def test_evaluations_are_the_direct_computation_and_run_at_stage_ends(tmp_path, capsys):
    cfg = tiny_config(STAGES, *EVAL, "train.steps=6", "train.dtype=float64", "logging.progress=false",
                      f"train.run_dir={tmp_path}", "eval.probe_samples=3", "checkpoint.keep_last=5")
    trainer = Trainer(cfg)
    history = run_training(trainer)
    evaluated = [h["step"] for h in history if "eval_loss" in h]
    assert evaluated == [2, 4, 6]  # eval.every=0: the end of each stage (and of the run)
    assert [h["step"] for h in history if "probe_accuracy" in h] == [2, 4, 6]
    last = history[-1]
    want = direct_eval_loss(trainer, last["seq_len"])
    assert {k: v for k, v in last.items() if k.startswith("eval_loss")} == pytest.approx(want, rel=1e-12)
    assert len(want) == 3 and 0 < last["eval_loss"] < 10
    want = direct_long_context(trainer, last["seq_len"])
    got = {k: v for k, v in last.items() if k.startswith(("eval_position_loss", "probe_accuracy"))}
    assert got == pytest.approx(want, rel=1e-12)
    assert list(got)[:4] == ["eval_position_loss.0-24", "eval_position_loss.24-96", "eval_position_loss.96-384",
                             "probe_accuracy"]  # seq_len 384: buckets from 384 / 16
    assert len([k for k in got if k.startswith("probe_accuracy.")]) == 9  # 3 lengths x 3 depths
    assert {k.split(".", 1)[1].split("@")[0] for k in got if k.startswith("probe_accuracy.")} == {
        "96", "192", "384"}  # named by the context the model reads (was 385 for the whole row)

    # On demand: launch.evaluate on the checkpoint of the first stage's end gives that step's record.
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert evaluate_main(["--config", str(config_file), str(tmp_path / "checkpoints" / "step_00000002"),
                          f"train.run_dir={tmp_path / 'evaluations'}"]) == 0
    for bad, said in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "checkpoints", "is not a checkpoint")):
        with pytest.raises(SystemExit) as exit_code:  # argparse's error: one line naming the path, exit 2
            evaluate_main(["--config", str(config_file), str(bad)])
        assert exit_code.value.code == 2 and said in capsys.readouterr().err
    (line,) = (tmp_path / "evaluations" / "evaluations.jsonl").read_text().splitlines()
    on_demand, at_step_2 = json.loads(line), history[1]
    assert on_demand["step"] == 2 and on_demand["seq_len"] == at_step_2["seq_len"] == 96
    assert {k: v for k, v in on_demand.items() if k.startswith(("eval_", "probe_"))} == pytest.approx(
        {k: v for k, v in at_step_2.items() if k.startswith(("eval_", "probe_"))}, rel=1e-12)
