"""Where full recomputation keeps the layers' inputs (train.saved_inputs, model/saved_inputs.py): the bytes
each policy keeps, against the plan's formula, and the training numbers it gives, in bf16 as users train.

The store is the saved-tensor hooks the layers' checkpoints run in; its ledger counts every tensor it is
handed (each once), so the figures are exact and the same on every machine."""

import pytest
import torch

from moe_pretrain.config import ConfigError, load_config
from moe_pretrain.model.init import initialize
from moe_pretrain.model.saved_inputs import FP8_BLOCK, saved_input_bytes
from moe_pretrain.model.transformer import MoETransformer
from moe_pretrain.planning.step_activations import activation_bytes, layer_activations
from tests.models import tiny_config
from tests.training_cases import saved_inputs_training

FP8_LOSS_GAP = 0.005
"""Largest |fp8 - device| step loss over 4 bf16 steps of the tiny model with the layers' inputs stored in
FP8, nats. Measured 4.0e-4 (at step 3; step 1's forward is the same, so its gap is 0)."""


def _store_after_forward(policy: str, dtype: torch.dtype):
    """The smoke model (d 128: whole FP8 blocks) after one forward under full recomputation, its store,
    the loss and the gradients of a backward from it."""
    cfg = load_config("configs/smoke.yaml", [])
    torch.manual_seed(0)
    model = initialize(MoETransformer(cfg.model), 0)
    store = model.set_recompute("full", policy)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(tokens)[0]
    loss = logits.float().square().mean()
    ledger = (store.elements, store.device_bytes, store.host_bytes)
    loss.backward()
    assert store._last is None or store._last() is None, "the store keeps a layer's inputs past its backward"
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return cfg, ledger, loss.detach(), grads


@pytest.mark.parametrize("policy", ["device", "host", "fp8"])
def test_each_policy_keeps_the_bytes_the_plan_says(policy):
    """float32 (every saved input 4 bytes, so the plan's activation dtype is exact): the store holds d per
    token per layer (the plan's full-recomputation coefficient), on the device, on the host, or as FP8
    values and one fp32 scale per 128 (saved_input_bytes); the plan's `other` and `host` are those bytes."""
    cfg, (elements, device, host), _, _ = _store_after_forward(policy, torch.float32)
    m, tokens = cfg.model, 2 * 64
    layers = list(range(m.num_layers))
    assert elements == sum(layer_activations(m, i, "full").other for i in layers) * tokens
    expected = {"device": (4 * elements, 0), "host": (0, 4 * elements),
                "fp8": (elements + 4 * elements // FP8_BLOCK, 0)}[policy]
    assert (device, host) == expected
    assert saved_input_bytes(policy, elements, 4) == expected
    plan = activation_bytes(m, layers, "full", tokens, act_bytes=4, saved_inputs=policy)
    if policy == "host":  # the GPU keeps the prefetch window: two layers' inputs and the bank entries
        assert plan.host == host and plan.other < 4 * elements
    else:
        assert (plan.other, plan.host) == expected


def test_host_keeps_the_numbers_and_fp8_stays_close_in_a_forward_and_backward():
    """bf16 autocast: the host copies give bitwise the loss and gradients of keeping the inputs on the
    device; FP8 inputs change the recomputed layers a little (measured: largest gradient gap 5.2e-4, largest
    gradient 8.9e-3)."""
    runs = {policy: _store_after_forward(policy, torch.bfloat16) for policy in ("device", "host", "fp8")}
    _, _, loss, grads = runs["device"]
    assert torch.equal(runs["host"][2], loss) and torch.equal(runs["host"][3], grads)
    assert torch.equal(runs["fp8"][2], loss)  # the forward is untouched: only the backward reads the store
    gap = (runs["fp8"][3] - grads).abs().max()
    assert 0 < gap <= 0.2 * grads.abs().max(), gap


def test_training_with_inputs_on_the_host_is_bitwise_and_in_fp8_within_tolerance(tmp_path):
    """Four bf16 steps of the tiny model through the trainer: host offload gives bitwise the losses, gradient
    norms and weights of keeping the inputs on the device; FP8 storage tracks them within FP8_LOSS_GAP."""
    runs = {policy: saved_inputs_training(tmp_path, policy) for policy in ("device", "host", "fp8")}
    history, weights, _ = runs["device"]
    host_history, host_weights, host_trainer = runs["host"]
    assert host_history == history
    assert all(torch.equal(host_weights[k], v) for k, v in weights.items())
    assert host_trainer.saved_inputs.policy == "host" and host_trainer.saved_inputs.host_bytes > 0
    assert host_trainer.saved_inputs.device_bytes == 0
    gaps = [abs(a[0] - b[0]) for a, b in zip(runs["fp8"][0], history)]
    assert gaps[0] == 0 and 0 < max(gaps) <= FP8_LOSS_GAP, gaps


@pytest.mark.parametrize("overrides, key", [
    (["train.saved_inputs=host"], "train.saved_inputs=host"),
    (["train.recompute=selective", "train.saved_inputs=fp8"], "train.saved_inputs=fp8"),
])
def test_a_policy_without_full_recomputation_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*recompute=full"):
        tiny_config(*overrides)
