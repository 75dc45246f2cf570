"""launch.plan --propose's fastest layouts (planning/fastest_layouts.py): the search loses nothing by its pruning.

The smoke schedule (configs/stages/tiny.yaml) on 8 GPUs of 0.2 GB, where the stages need context parallelism and
the smallest layout is not the fastest. The search tries, on each run layout and stage, the cheapest
recomputation that fits at each cp and MLA exchange, at the most micro-batches. Here every stage layout of every
run layout is tried instead: every cp, recomputation, saved-input place, exchange and micro-batch count the rules
allow. The fastest days found that way must be the search's, and the search's winner must fit.
"""

import dataclasses
import itertools

import pytest

from moe_pretrain.config import load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.gpus import GPUS
from moe_pretrain.planning.fastest_layouts import fastest_layouts
from moe_pretrain.planning.plan_step_time import planned_step
from moe_pretrain.planning.stage_memory import (
    HEADROOM,
    RECOMPUTE_ORDER,
    SAVED_INPUTS_ORDER,
    MemoryPlanner,
)

GPU_BYTES = 0.2e9


def every_fitting_step(planner: MemoryPlanner, run, stage) -> list[float]:
    """The planned step of every stage layout that fits with HEADROOM, by brute force."""
    found = []
    for cp in (1, 2, 4, 8):
        rows = run.gpus // (run.tp * run.pp * cp) if run.gpus % (run.tp * run.pp * cp) == 0 else 0
        if not rows or stage.rows % rows:
            continue
        for micro, recompute, saved, mla in itertools.product(
                range(1, stage.rows // rows + 1), RECOMPUTE_ORDER, SAVED_INPUTS_ORDER, ("ulysses", "latent")):
            if saved != "device" and recompute != "full":
                continue
            candidate = dataclasses.replace(stage, cp=cp, recompute=recompute, micro_batches=micro, cp_mla=mla,
                                            saved_inputs=saved)
            result = planner.fits(run, candidate, GPU_BYTES, HEADROOM)
            if result is not None:
                found.append(planned_step(planner.cfg, run, candidate, result["ranks"], GPUS["h200"],
                                          planner.cfg.cluster).days)
    return found


@pytest.mark.timeout(300)
def test_the_fastest_layout_is_the_fastest_of_every_layout_that_fits():
    cfg = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml"])
    ranked = fastest_layouts(MemoryPlanner(cfg), 8, GPU_BYTES, GPUS["h200"])
    assert len(ranked) == 3 and [r.days for r in ranked] == sorted(r.days for r in ranked)
    planner = MemoryPlanner(cfg)  # a fresh one: the brute force shares no cache with the search
    best = None
    for run in planner.run_layouts(8):
        per_stage = [every_fitting_step(planner, run, stage) for stage in resolve_stages(cfg)]
        if all(per_stage):
            days = sum(min(steps) for steps in per_stage)
            best = days if best is None else min(best, days)
    assert ranked[0].days == pytest.approx(best, rel=1e-12)
    winner = ranked[0]
    for stage, _ in winner.stages:
        assert planner.fits(winner.run, stage, GPU_BYTES, HEADROOM) is not None
    # Not the smallest layout that fits (propose's: tp=1 pp=1 ep=8, tests/distributed/test_stages.py).
    assert (winner.run.tp, winner.run.pp) != (1, 1)
