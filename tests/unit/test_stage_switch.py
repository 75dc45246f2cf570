"""A stage boundary (training/stage_switch.py) sets on the modules what the new stage changes and only that:
the activation plan again where cp or MLA's exchange changes, recomputation where it or the saved inputs'
place changes, MLA's RoPE base where it changes; a stage like the one in force touches nothing."""

import dataclasses

from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.model.mla import GatedMLA
from moe_pretrain.training import stage_switch
from moe_pretrain.training.stage_switch import StageSwitch
from parallel.parallelize import build_model
from parallel.state import ParallelContext
from tests.models import STAGES, tiny_config


def test_a_boundary_applies_what_changes_and_nothing_else(monkeypatch):
    stages = STAGES.replace("lr_peak: 0.001, lr_end: 0.0001", "lr_peak: 0.001, lr_end: 0.0001, rope_theta: 500000")
    cfg = tiny_config(stages, "train.steps=6", "model.mla.position=rope")
    model = build_model(cfg)
    calls = []
    monkeypatch.setattr(stage_switch, "apply_activation_plan", lambda *_: calls.append("activation plan"))
    set_recompute = model.set_recompute
    monkeypatch.setattr(model, "set_recompute", lambda *args: calls.append(f"recompute {args[0]}")
                        or set_recompute(*args))
    switch = StageSwitch(model, ParallelContext.single(), exchanges=True)
    first, second, third = resolve_stages(cfg)

    def thetas():
        return {m.rope_theta for m in model.modules() if isinstance(m, GatedMLA)}

    switch.apply(first)  # the first stage sets everything
    assert calls == ["activation plan", "recompute none"] and thetas() == {10000.0}
    switch.apply(second)  # another length and rows: nothing the modules hold
    assert calls == ["activation plan", "recompute none"]
    switch.apply(dataclasses.replace(second, recompute="full"))
    assert calls[-1] == "recompute full" and len(calls) == 3
    switch.apply(dataclasses.replace(third, recompute="full"))  # only the RoPE base changes
    assert len(calls) == 3 and thetas() == {500000.0}
    assert switch.applied.rope_theta == 500000.0
