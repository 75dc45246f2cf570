"""bf16 training (autocast over fp32 master weights) in the trainer: the routed experts' compute copies follow
every optimizer step, and the run tracks the float32 run's losses.

The defect these catch was invisible to float32 / float64 tests: the experts' bf16 copies were cached on the
parameters' version counters, which the sharded optimizer's flat-buffer writes never bump, so every bf16 run
computed with the step-1 experts while their masters trained. The first test catches it directly; the loss
gap of 20 tiny steps cannot (measured over train.seed 0-3: 0.0005-0.0056 nats with fresh copies, 0.0020-0.0051
with copies frozen at step 1), so the tracking test bounds bf16's own drift from float32 only.
"""

import pytest
import torch

from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import tiny_config
from tests.training_cases import assert_bf16_tracks_float32, bf16_and_float32_losses, bf16_trainer


def test_expert_compute_copies_are_fresh_casts_of_the_masters_at_every_step(tmp_path):
    trainer = bf16_trainer(tmp_path, steps=3)
    experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
    first = experts[0]
    probe_rows = torch.randn(12, first.w_gate.shape[2], generator=torch.Generator().manual_seed(0))
    probe_counts = torch.tensor([3, 0, 5, 4] + [0] * (first.w_gate.shape[0] - 4))
    fresh, probes = [], []

    def record(module, args, output):
        """The copies this forward used (asked again inside the step's region) against casts made now."""
        used = module.compute_weights()
        masters = (module.w_gate, module.w_up, module.w_down)
        fresh.append(all(torch.equal(c, w.detach().to(torch.bfloat16)) for c, w in zip(used, masters)))
        if module is first:  # the experts as this step computes them, on the same rows every step
            probes.append(module.forward(probe_rows, probe_counts).detach().float())

    for module in experts:
        module.register_forward_hook(record)
    for _ in range(3):
        trainer.train_step()
    assert len(probes) == 3 and len(fresh) == 3 * len(experts)
    stale = [divmod(i, len(experts)) for i, ok in enumerate(fresh) if not ok]
    assert not stale, f"stale compute copies at (0-based step, layer): {stale}"
    # The experts the forward computes with change from step to step (a frozen copy gives equal outputs).
    assert not torch.equal(probes[0], probes[1]) and not torch.equal(probes[1], probes[2])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bf16_training_tracks_float32(tmp_path, optimizer):
    """With either optimizer (Muon's Newton-Schulz runs in float32 on the fp32 masters' momentum; measured
    largest gap over train.seed 0-3: 0.0005-0.0012 nats)."""
    assert_bf16_tracks_float32(bf16_and_float32_losses(tmp_path, None, f"optim.name={optimizer}"))


def test_bf16_recomputation_reuses_the_steps_copies_and_trains_identically(tmp_path):
    """A recomputed forward (train.recompute) finds the step's compute copies and computes exactly what the
    first pass did: bitwise the same losses, gradient norms and weights as without recomputation."""
    runs = {}
    for mode in ("none", "selective", "full"):
        cfg = tiny_config("train.steps=3", "train.dtype=bfloat16", f"train.recompute={mode}",
                          f"train.run_dir={tmp_path / mode}", "logging.progress=false")
        trainer = Trainer(cfg)
        runs[mode] = ([(h["loss"], h["grad_norm"]) for h in run_training(trainer)], trainer.model.state_dict())
    for mode in ("selective", "full"):
        assert runs[mode][0] == runs["none"][0], mode
        assert all(torch.equal(runs[mode][1][k], v) for k, v in runs["none"][1].items()), mode


def test_each_weight_gradient_reaches_its_master_as_its_layer_finishes_backward():
    """The step's bf16 copies (step_reuse.cast_for_step) give every use its own cast node, so a layer's weight
    gradient is accumulated into the fp32 master as soon as that layer's backward is done; one shared cast node
    (autocast's cache, or a cast made at the step's first use) runs after every other node, holding each
    layer's bf16 weight gradient until the backward ends (about 20 GB per rank at full size)."""
    from moe_pretrain.model.linear import make_linear
    from moe_pretrain.step_reuse import reused_in_step

    layers = [make_linear(16, 16) for _ in range(3)]
    events = []
    for i, layer in enumerate(layers):
        layer.weight.register_post_accumulate_grad_hook(lambda p, i=i: events.append(f"weight {i}"))
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), reused_in_step():
        for _ in range(2):  # two micro-batches share the step's copies
            h = x
            for i, layer in enumerate(layers):
                h = torch.tanh(layer(h))
                h.register_hook(lambda grad, i=i: events.append(f"layer {i}"))
            h.float().sum().backward()
    assert events == 2 * ["layer 2", "weight 2", "layer 1", "weight 1", "layer 0", "weight 0"], events
