"""Multi-token prediction (model/mtp.py): a step's logged block losses against a direct computation of the chain
from the model's weights, targets written out from the tokens, the loss weight's effect, and the export
dropping the blocks. (Layouts against one process: tests/distributed/test_parallel_training.py.)"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from moe_pretrain.data import IGNORE_INDEX, PretrainingData
from moe_pretrain.data.patches import placed_images
from moe_pretrain.model.mtp import mtp_labels
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.checkpoints_cli import config_file_of, tool
from tests.models import MXFP4_TINY, tiny_config


def config(tmp_path, *overrides):
    return tiny_config("train.dtype=float64", "data.batch_size=8", "train.steps=2", "logging.progress=false",
                       f"train.run_dir={tmp_path}", *overrides)


def written_out_targets(tokens: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Block k's target at (b, t): token t + k + 1 when it is in t's document and the next-token loss takes token
    t + k + 1 at t + k (labels there is not IGNORE_INDEX: not an image token or padding); IGNORE_INDEX otherwise.
    The row's tokens go on past T by its last label (the packer's next token, in the last position's document)."""
    B, T = tokens.shape
    stream = torch.cat([tokens, labels[:, -1:]], dim=1)
    documents = torch.cat([doc_ids, doc_ids[:, -1:]], dim=1)
    out = torch.full((B, T), IGNORE_INDEX)
    for b in range(B):
        for t in range(T - k):
            if documents[b, t + k + 1] == doc_ids[b, t] and labels[b, t + k] != IGNORE_INDEX:
                out[b, t] = stream[b, t + k + 1]
    return out


def direct_block_losses(model, batch) -> list[float]:
    """The chain by hand from the model's modules: h_0 = the final AttnRes mix (taken by a hook on the backbone's
    own forward), x = W [norm(h); norm(E[token t + k])], h_k = x + layer([x]), mean cross-entropy of head(norm_k
    (h_k)) against the written-out targets."""
    captured = {}
    hook = model.final_mix.register_forward_hook(lambda _m, _i, out: captured.setdefault("h", out))
    images = placed_images(batch.grids, batch.starts)
    model(batch.tokens, batch.doc_ids, batch.patches, batch.image_mask, images)
    hook.remove()
    layout = model.layout(batch.tokens, batch.doc_ids)
    hidden, losses = captured["h"], []
    for k, block in enumerate(model.mtp.values(), start=1):
        embedded = model.embedding(torch.cat([batch.tokens[:, k:], batch.tokens[:, :k]], dim=1))  # wrap: no target
        x = block.projection(torch.cat([block.hidden_norm(hidden), block.embedding_norm(embedded)], dim=-1))
        hidden = x + block.layer([x], None, layout)[0]
        logits = model.head(block.norm(hidden))
        targets = written_out_targets(batch.tokens, batch.labels, batch.doc_ids, k)
        losses.append(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)))
    return losses


def test_block_losses_match_a_direct_computation(tmp_path):
    """Two blocks: the trainer's logged mtp_loss of step 1 equals the direct chain on the same batch (1e-12), and
    model/mtp.py's targets equal the written-out ones."""
    trainer = Trainer(config(tmp_path, "model.mtp.layers=2"))
    batch = PretrainingData(trainer.cfg).next_batch(8)
    for k in (1, 2):
        assert torch.equal(mtp_labels(batch.labels, batch.doc_ids, 2)[:, k - 1],
                           written_out_targets(batch.tokens, batch.labels, batch.doc_ids, k))
    assert (mtp_labels(batch.labels, batch.doc_ids, 2) != IGNORE_INDEX).sum() > 0.8 * batch.tokens.numel()
    with torch.no_grad():
        want = direct_block_losses(trainer.model, batch)
    result = trainer.train_step()
    assert list(result.mtp_losses) == pytest.approx(want, rel=1e-12)


def test_loss_weight_trains_the_blocks_and_zero_leaves_the_backbone_alone(tmp_path):
    """loss_weight 0: the backbone's losses and weights are those of a model without blocks (1e-12; the blocks
    take their own initialisation, not the backbone's) and the blocks do not move; 0.3: they train."""
    plain = Trainer(config(tmp_path / "plain"))
    plain_losses = [h["loss"] for h in run_training(plain)]
    off = Trainer(config(tmp_path / "off", "model.mtp.layers=1", "model.mtp.loss_weight=0"))
    start = {name: p.detach().clone() for name, p in off.model.named_parameters() if name.startswith("mtp.")}
    assert [h["loss"] for h in run_training(off)] == pytest.approx(plain_losses, rel=1e-12)
    backbone = plain.model.state_dict()
    for name, tensor in off.model.state_dict().items():
        if not name.startswith("mtp."):
            assert torch.allclose(tensor, backbone[name], rtol=1e-12, atol=1e-15), name
    # Only weight decay moves them (the gradient is zero): each by the same factor, (1 - lr wd) per step.
    moved = {name: float((p.detach() - start[name]).norm() / start[name].norm().clamp_min(1e-30))
             for name, p in off.model.named_parameters() if name.startswith("mtp.") and p.dim() >= 2}
    assert max(moved.values()) < 1e-3, moved
    on = Trainer(config(tmp_path / "on", "model.mtp.layers=1", "model.mtp.loss_weight=0.3"))
    start = {name: p.detach().clone() for name, p in on.model.named_parameters() if name.startswith("mtp.")}
    run_training(on)
    trained = [name for name, p in on.model.named_parameters()
               if name.startswith("mtp.") and not torch.allclose(p.detach(), start[name], rtol=1e-3, atol=0)]
    assert "mtp.0.projection.weight" in trained and "mtp.0.layer.mixer.q_up.weight" in trained, trained


@pytest.mark.timeout(300)
def test_release_export_keeps_the_blocks_aside_and_a_release_without_them_starts_them_fresh(tmp_path):
    """The released layout has no multi-token-prediction layer (num_nextn_predict_layers 0): its files and index
    hold the backbone only, the block's tensors go to the extras file whole, and the export says so. A release
    without them (the extras file stripped of mtp.*) imports with a note, and a run with the block resumes it:
    the backbone as imported, the block at its initial values."""
    cfg = config(tmp_path / "run", *MXFP4_TINY, "model.mtp.layers=1", "train.steps=1", "train.dtype=float32")
    trained = Trainer(cfg)
    run_training(trained)
    done = tool("export", tmp_path / "run" / "checkpoints", tmp_path / "hf", "--format", "kimi-k3-hf")
    assert done.returncode == 0, done.stderr
    assert "1 multi-token-prediction block(s) (mtp.*)" in done.stdout and "num_nextn_predict_layers 0" in done.stdout
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [name for name in index if "mtp" in name]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]["num_nextn_predict_layers"] == 0
    with safe_open(str(tmp_path / "hf" / "moe_pretrain_extras.safetensors"), framework="pt") as f:
        kept = [name for name in f.keys() if name.startswith("mtp.0.")]
    assert "mtp.0.projection.weight" in kept and "mtp.0.layer.mlp.experts.w_gate" in kept
    extras = tmp_path / "hf" / "moe_pretrain_extras.safetensors"
    with safe_open(str(extras), framework="pt") as f:
        rest = {name: f.get_tensor(name) for name in f.keys() if not name.startswith("mtp.")}
    save_file(rest, str(extras))
    done = tool("import", tmp_path / "hf", tmp_path / "imported", "--config", config_file_of(cfg, tmp_path))
    assert done.returncode == 0, done.stderr
    assert "holds no multi-token-prediction block" in done.stdout
    resumed = Trainer(config(tmp_path / "again", *MXFP4_TINY, "model.mtp.layers=1", "train.dtype=float32",
                             f"train.resume={tmp_path / 'imported' / 'step_00000000'}",
                             f"checkpoint.dir={tmp_path / 'imported'}"))
    resumed.checkpoints.resume()
    fresh = Trainer(config(tmp_path / "fresh", *MXFP4_TINY, "model.mtp.layers=1", "train.dtype=float32"))
    ours, initial, imported = (dict(t.model.named_parameters()) for t in (resumed, fresh, trained))
    assert all(torch.equal(p, initial[name]) for name, p in ours.items() if name.startswith("mtp."))
    q_up = "layers.2.mixer.q_up.weight"  # the release stores it in bf16
    assert torch.equal(ours[q_up], imported[q_up].detach().to(torch.bfloat16).float())
    assert not torch.equal(ours[q_up], initial[q_up])
