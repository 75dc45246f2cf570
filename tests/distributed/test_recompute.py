"""Activation recomputation (train.recompute) across processes: full recomputation without repeating the
expert exchanges, and recomputation by module, each against its reference (in one process:
tests/integration/test_recompute_runs.py; the peak memory: tests/unit/test_activation_memory.py)."""

import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.planning.collective_traffic import CollectiveTraffic
from moe_pretrain.training import Trainer
from parallel.collectives import gather_objects
from parallel.parallelize import gather_full_state
from parallel.state import destroy_parallel, init_parallel
from tests.distributed.test_parallel_training import assert_layout_matches_single_process
from tests.models import tiny_config


def kept_exchanges_worker(rank, world_size, run_dir, exchanges, overrides):
    cfg = tiny_config("train.steps=3", "train.dtype=bfloat16", "logging.progress=false", "data.batch_size=8",
                      f"train.run_dir={run_dir}", "parallel.dispatch_chunks=2", "train.recompute=full",
                      f"train.recompute_exchanges={str(exchanges).lower()}", *overrides)
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        groups = {"ep": ctx.ep_group, "ep rail": ctx.ep_rail_group, "ep node": ctx.ep_node_group}
        with CollectiveTraffic(groups) as traffic:
            history = run_training(trainer)
        losses = [(h["loss"], h["grad_norm"]) for h in history]
        sent = sum(traffic.sent_bytes().get(group, 0) for group in groups)
        return losses, gather_full_state(trainer.model, ctx), gather_objects(sent, dist.group.WORLD)
    finally:
        destroy_parallel()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("world_size", "overrides"), [
    (2, ["parallel.ep=2"]),
    (4, ["parallel.ep=4", "parallel.expert_dispatch=node", "parallel.ranks_per_node=2"]),
], ids=["ep2", "ep4-by-node-2x2"])
def test_full_recompute_without_repeating_the_exchanges_trains_bitwise_alike_and_sends_two_passes(
        tmp_path, world_size, overrides):
    """train.recompute_exchanges=false: three bf16 steps in 2 chunks give bitwise the losses, gradient norms and
    parameters of full recomputation that repeats its exchanges, and the expert group sends the forward's and
    the backward's rows but not the re-forward's (a third of three passes, and a little over: the forward also
    sends the routing's split counts and, by node, the expert ids and weights, which the backward does not)."""
    repeated = run_distributed(kept_exchanges_worker, world_size, tmp_path / "repeated", True, overrides,
                               timeout=300)
    kept = run_distributed(kept_exchanges_worker, world_size, tmp_path / "kept", False, overrides, timeout=300)
    (want_losses, want_state, want_sent), (losses, state, sent) = repeated, kept
    assert losses == want_losses
    for name, tensor in want_state.items():
        assert torch.equal(state[name], tensor), name
    for rank, (forward_and_back, three_passes) in enumerate(zip(sent, want_sent, strict=True)):
        reforward = three_passes - forward_and_back
        assert 1 / 3 <= reforward / three_passes < 0.36, (rank, reforward, three_passes)


MODULES = "train.recompute=attn_res,norms,kda_pre,mla_up,core,expert_act"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recompute_by_module_matches_single_process_float64(tmp_path):
    """Every module recomputed on cp2 x tp2 x ep2 with paired micro-batches and MLA's latent exchange: the
    regions that hold exchanges (KDA's convolution halos inside kda_pre; the sequence-parallel gathers stay
    outside mla_up, whose query region the latent exchange recomputes alone) run them again in the backward on
    every rank alike, and three float64 steps match one process (1e-9 relative: losses, gradient norms, every
    parameter and balancing bias). Ulysses' head exchanges inside a recomputed core are full recomputation's
    case in tests/distributed/test_context_parallel.py."""
    assert_layout_matches_single_process(tmp_path, 4, [
        MODULES, "parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "model.mla.num_heads=4",
        "parallel.cp_mla=latent", "data.micro_batches=2", "parallel.overlap_micro_batches=true"])
