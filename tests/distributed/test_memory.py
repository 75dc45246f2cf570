"""Memory that tracks what a rank holds (bench/memory.py on a smaller probe, counting live tensor bytes), sizing's
per-rank plan against the state a layout really allocates, and streaming export."""

import json
import subprocess
import sys

import pytest

from bench.memory import PHASES, live_ratio, run_layout
from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.model.counts import count
from moe_pretrain.planning.rank_state import per_rank_bytes
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel

PROBE = "configs/probe_memory.yaml"
SMALL = ["model.moe.num_experts=16", "model.moe.expert_intermediate=512", "model.moe.latent_size=256"]
"""44M parameters (176 MB in fp32, 98% routed experts)."""
MID = ["model.moe.num_experts=32", "model.moe.expert_intermediate=512", "model.moe.latent_size=256"]
"""90M parameters: 1.4 GB of state on one process, 0.38 GB on each of 4 expert-parallel ranks."""
BOUND = 1.15
"""Peak live tensor bytes of each phase (build, two steps, a save) per byte of the state the rank holds (16 B a
parameter): 1.0 is a rank holding its state and nothing else. Measured (measured.LiveTensorBytes, exact):
one process 0.76 / 1.09 / 1.00, ep4 0.96 / 1.07 / 1.03 (build / step / save). Live tensor bytes are counted op
by op, the same on every machine; `python bench/memory.py` adds the process's own figures beside them."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world_size", "overrides"), [(1, []), (4, ["parallel.ep=4"])], ids=["1-process", "ep4"])
def test_peak_memory_tracks_the_state_each_rank_holds(world_size, overrides):
    rows = run_layout(PROBE, world_size, [*MID, *overrides])
    assert len(rows) == world_size
    worst = max(rows, key=lambda row: max(live_ratio(row, phase) for phase in PHASES))
    assert max(live_ratio(worst, phase) for phase in PHASES) <= BOUND, worst
    total = count(load_config(PROBE, MID).model, 32)["total_params"]
    # ep4: a rank holds a quarter of the experts (plus the small dense part), never the whole model.
    assert max(row["params"] for row in rows) < (0.27 if world_size > 1 else 1.01) * total


def allocated_state(rank, world_size, overrides):
    cfg = load_config(PROBE, [*SMALL, *overrides, "logging.progress=false", "train.run_dir=/nonexistent"])
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.train_step()
        params = sum(p.numel() for p in trainer.model.parameters())
        grads = sum(b.grad_data.numel() for b in trainer.optimizer.buckets)
        exchanged = trainer.optimizer.exchange_bytes()
        held = (trainer.optimizer.param_bytes(), trainer.optimizer.grad_bytes())
        return [(ctx.pp_rank, params, grads, trainer.optimizer.state_bytes(), exchanged, held)]
    finally:
        destroy_parallel()


BF16_HELD = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.grad_dtype=bfloat16"]
"""The matmuls' weights held in bf16 with fp32 masters in the optimizer, their gradients in bf16."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("optimizer", "precision"), [("adamw", []), ("muon", []), ("muon", BF16_HELD)],
                         ids=["adamw", "muon", "muon-bf16-held"])
def test_sizing_per_rank_matches_what_the_layout_allocates(optimizer, precision):
    """With Muon the plan's state is one momentum for Muon's parameters (checked against what the optimizer
    allocates), and its exchange bytes against what the all-to-alls' splits send (the plan prices (size - 1) /
    size of each slice as owned elsewhere; the owners' balance moves the real figure: measured 0.77 of the plan
    on pipeline stage 0; 39.4 MB of state against AdamW's 78.7 MB). With the weights held in bf16 the parameters
    and gradients the plan prices are the bytes the buckets hold, and the masters join the optimizer's state."""
    overrides = ["parallel.pp=2", "parallel.ep=2", f"optim.name={optimizer}", *precision]
    pp_rank, params, grads, optimizer_bytes, exchanged, held = run_distributed(allocated_state, 4, overrides)[0]
    plan = per_rank_bytes(load_config(PROBE, [*SMALL, f"optim.name={optimizer}", *precision]), "pp=2,ep=2,dp=2")
    stage = plan["stages"][pp_rank]
    assert stage["params"] == params
    # Buckets pad to a multiple of the group size: a few elements per bucket at most.
    assert 0 <= grads - params < 100 and abs(stage["optimizer_bytes"] - optimizer_bytes) <= 8 * 100
    assert 0 <= held[0] - stage["param_bytes"] < 4 * 100 and 0 <= held[1] - stage["grad_bytes"] < 4 * 100
    if precision:  # 98% of the parameters are routed experts: about half the bytes of fp32
        assert held[0] < 0.55 * 4 * params and held[1] < 0.55 * 4 * params
    if optimizer == "adamw":
        assert exchanged == stage["muon_exchange_bytes"] == stage["muon_flops"] == 0
    else:
        assert 0.6 <= exchanged / stage["muon_exchange_bytes"] <= 1.2 and stage["muon_flops"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sizing_layout_cli_names_the_worst_rank():
    out = subprocess.run([sys.executable, "-m", "moe_pretrain.planning.sizing", "configs/full.yaml", "--json",
                          "--layout", "tp=8,pp=16,ep=128,dp=32"], capture_output=True, text=True, check=True)
    per_rank = json.loads(out.stdout)["per_rank"]
    assert len(per_rank["stages"]) == 16 and per_rank["layout"]["world_size"] == 4096
    worst = per_rank["worst"]
    assert worst["total_bytes"] == max(s["total_bytes"] for s in per_rank["stages"])
    assert worst["rank"] == worst["pp_rank"] * 256
    # 2.8T parameters over 4096 ranks, fp32 state: ~2.1e9 parameters and ~23 GB on the fullest stage (the first:
    # its share of the embedding plus the whole vision tower and projector, 0.45e9, replicated over tp).
    assert 1.5e9 < worst["params"] < 2.7e9 and worst["total_bytes"] < 35e9
    # Counted two ways: unsharded (tp = ep = 1), the pipeline stages' parameters from the meta model's shapes add
    # up to sizing's analytic count of the whole model, exactly.
    whole = json.loads(subprocess.run([sys.executable, "-m", "moe_pretrain.planning.sizing", "configs/full.yaml",
                                       "--json", "--layout", "tp=1,pp=16,ep=1,dp=256"], capture_output=True,
                                      text=True, check=True).stdout)
    assert sum(stage["params"] for stage in whole["per_rank"]["stages"]) == whole["total_params"]
    bad = subprocess.run([sys.executable, "-m", "moe_pretrain.planning.sizing", "configs/full.yaml", "--layout",
                          "tp=8,pp=16,ep=100,dp=32"], capture_output=True, text=True)
    assert bad.returncode != 0 and "parallel.ep=100" in bad.stderr
