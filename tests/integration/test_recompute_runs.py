"""Activation recomputation in one process: selective and full train as without it, and each mode reruns the regions
it names."""

import pytest
import torch

from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.parallelize import build_model
from tests.helpers import rel_rms
from tests.models import tiny_config


def run(tmp_path, mode):
    cfg = tiny_config("train.steps=3", "train.dtype=float64", "logging.progress=false",
                      f"train.run_dir={tmp_path / mode}", f"train.recompute={mode}")
    trainer = Trainer(cfg)
    history = run_training(trainer)
    return [(h["loss"], h["grad_norm"]) for h in history], trainer.model.state_dict(), history


@pytest.fixture(scope="module")
def without_recompute(tmp_path_factory):
    return run(tmp_path_factory.mktemp("none"), "none")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_trains_like_none(tmp_path, mode, without_recompute):
    """Three float64 steps under quantile balancing: losses, gradient norms, parameters and expert biases
    equal the run without recomputation (1e-12), and so do the routers' statistics: a router that counted
    the recomputed tokens again would report twice the loads and tokens (its quantile bias would not show
    it: every score twice has the same quantiles; tried, this test then fails on the statistics)."""
    ref_losses, ref_state, ref_history = without_recompute
    losses, state, history = run(tmp_path, mode)
    assert [x for pair in losses for x in pair] == pytest.approx([x for pair in ref_losses for x in pair], rel=1e-12)
    for name, tensor in ref_state.items():
        assert rel_rms(state[name], tensor) < 1e-12, name  # expert_bias buffers included
    for got, want in zip(history, ref_history):
        assert got["moe"] == want["moe"]  # loads, entropy, tokens routed and dropped, counted once


def count_calls(module_type, model):
    calls = []
    for module in model.modules():
        if isinstance(module, module_type):
            module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(("mode", "layer_runs", "core_runs"), [("none", 1, 1), ("selective", 1, 2), ("full", 2, 2)])
def test_recomputation_reruns_its_regions(monkeypatch, mode, layer_runs, core_runs):
    """One forward + backward runs each KDA layer (and its chunked op) once, or twice where recomputed."""
    import moe_pretrain.model.kda as kda_layer

    cfg = tiny_config()
    model = build_model(cfg)
    model.set_recompute(mode)
    layers = count_calls(KimiDeltaAttention, model)
    cores = []
    real_kda = kda_layer.kda
    monkeypatch.setattr(kda_layer, "kda", lambda *a, **k: cores.append(1) or real_kda(*a, **k))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    logits, balance = model(tokens)
    kda_layers = cfg.model.layer_pattern.count("K")
    assert (len(layers), len(cores)) == (kda_layers, kda_layers)
    (logits.sum() + balance).backward()
    assert (len(layers), len(cores)) == (layer_runs * kda_layers, core_runs * kda_layers)
