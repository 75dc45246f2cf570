"""launch.plan on the staged schedules: each stage's memory on the stated layout, a proposed layout per stage, and
where full recomputation keeps the layers' inputs."""

import pytest

from moe_pretrain.config import load_config


@pytest.mark.timeout(120)
def test_plan_prints_the_schedule_and_its_memory(capsys):
    """The full-size schedule on its stated layout (configs/stages/full.yaml: 2048 H200, tp 4 x pp 4, MLA's
    latent exchange under cp): every stage valid and fitting, 1M included, with the weights' bf16 copies and the
    gradient shards counted; every stage keeps 8% of the GPU, not the 10% --propose asks for."""
    from launch.plan import main

    code = main(["--config", "configs/full.yaml", "--config", "configs/stages/full.yaml", "--gpus", "2048"])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("8k", "64k", "256k", "1m"):
        assert f"\n{name} " in out
    assert "days" in out and "231250" in out
    memory = out.split("memory per GPU")[1]
    verdicts = {line.split()[0]: line.split("|")[0].split()[-1] for line in memory.splitlines()[2:] if "|" in line}
    assert verdicts == {"8k": "yes", "64k": "yes", "256k": "yes", "1m": "yes"}, memory
    assert "\n1m       cp=128 latent full M=64 " in memory
    assert memory.splitlines()[1].split("|")[0].split()[-3:] == ["total", "host", "fits"]
    totals = [float(line.split("|")[0].split()[-3]) for line in memory.splitlines()[2:] if "|" in line]
    assert len(totals) == 4 and max(totals) <= 0.92 * 141, memory
    # Days from the plan's step-time model (no assumed MFU): every stage priced, the total their sum.
    times = out.split("step time on 2048 x h200")[1].splitlines()
    rows = {line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:4]] for line in times[2:6]}
    assert list(rows) == ["8k", "64k", "256k", "1m"] and all(step > 0 and 0 < mfu < 100 for step, mfu, _ in
                                                               rows.values()), times
    total = float(times[6].split("total days: ")[1].split()[0])
    assert total == pytest.approx(sum(days for _, _, days in rows.values()), abs=0.2)
    assert times[7].startswith("verdict: fits: every stage within 141 GB a GPU")


@pytest.mark.timeout(120)
def test_plan_proposes_a_layout_per_stage(capsys):
    """The smoke schedule on 8 GPUs of 0.2 GB: the longer stage takes cp 2 (Ulysses: the smoke model's 2
    MLA heads divide); the longest has 2 sequences per batch, so it needs cp 4, beyond the heads: the
    latent exchange (before it, the heads' cap left that stage with no layout)."""
    from launch.plan import main

    code = main(["--config", "configs/smoke.yaml", "--config", "configs/stages/tiny.yaml", "--gpus", "8",
                 "--gpu-gb", "0.2", "--propose"])
    out = capsys.readouterr().out
    assert code == 0, out
    proposal = out.split("proposed: ")[1]
    assert proposal.startswith("tp=1 pp=1 ep=8")
    assert "\nctx512   cp=2 none M=1 " in proposal
    assert "\nctx1024  cp=4 latent none M=1 " in proposal


@pytest.mark.timeout(120)
def test_plan_moves_the_saved_inputs_where_the_stage_says(monkeypatch):
    """The full-size 1m stage on its layout with the layers' inputs on the device, the host and in FP8: the
    host policy moves them off the GPU (but its prefetch window), FP8 keeps 1 + 4 / 128 bytes a value for
    bf16's 2, and a stage whose offloaded inputs exceed the node's host memory does not fit."""
    from dataclasses import replace

    from moe_pretrain.config.stage import resolve_stages
    from moe_pretrain.gpus import GPUS
    from moe_pretrain.planning import stage_memory
    from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout

    cfg = load_config(["configs/full.yaml", "configs/stages/full.yaml"])
    planner, run = MemoryPlanner(cfg), RunLayout(2048, 4, 4, 128)
    stage = resolve_stages(cfg)[3]
    # One pipeline rank under every policy (the first: the most micro-batches in flight); the worst rank may
    # differ between policies.
    first = {policy: planner.stage(run, replace(stage, saved_inputs=policy))["first"]
             for policy in ("device", "host", "fp8")}
    device, host, fp8 = first["device"], first["host"], first["fp8"]
    moved = host["host_bytes"]
    assert device["host_bytes"] == fp8["host_bytes"] == 0 and moved > 0
    # The host policy frees what it moved but its prefetch window of layers' inputs (kept on the device).
    assert 0 < device["total_bytes"] - host["total_bytes"] < moved
    assert device["total_bytes"] - fp8["total_bytes"] == pytest.approx(moved * (1 - (1 + 4 / 128) / 2), rel=1e-9)
    gpu = GPUS["h200"].memory_bytes
    assert planner.fits(run, replace(stage, saved_inputs="host"), gpu) is not None
    monkeypatch.setattr(stage_memory, "HOST_BYTES_PER_GPU", moved / 2)
    assert planner.fits(run, replace(stage, saved_inputs="host"), gpu) is None
