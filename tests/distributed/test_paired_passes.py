"""One micro-batch's forward beside another's backward (parallel.overlap_micro_batches) on gloo: the paired
step trains exactly as the unpaired one does. In float64 every layout matches one process (losses, gradient
norms, every parameter and balancing bias after three steps, 1e-9 relative), with hand-overs on every rank:
the expert exchanges with full recomputation in 2 chunks, a pipeline's paired 1F1B by node, the
context-parallel exchanges (KDA's entry states and halo, MLA's latent) and the forward's tensor-parallel
collectives started and waited for around a turn of the other pass. Under bf16 autocast the paired step is
bitwise the unpaired one (each op sees the same inputs, and the gradients accumulate in the same micro-batch
order), which also holds the unpaired layout against the float64 one above."""

import sys
from unittest import mock

import pytest
import torch

from launch.local import run_distributed
from parallel import collectives
from parallel.paired_passes import hand_over, hand_overs
from tests.distributed.test_parallel_training import assert_layout_matches_single_process, train_worker

PAIRED = "parallel.overlap_micro_batches=true"


def paired_worker(rank, world_size, run_dir, dtype, overrides):
    """train_worker, noting which collectives' waits handed the turn over (their callers' names)."""
    sites = set()

    def noted_hand_over():
        sites.add(sys._getframe(1).f_code.co_name)
        hand_over()

    with mock.patch.object(collectives, "hand_over", noted_hand_over):
        result = train_worker(rank, world_size, run_dir, dtype, overrides)
    assert hand_overs() > 0, f"rank {rank} never handed over: nothing ran as a pair"
    assert {"forward", "backward"} <= sites, sites  # the rows' waits, forward and backward
    if any(o.startswith(("parallel.cp=", "parallel.tp=")) for o in overrides):
        assert "_beside_a_pair" in sites, sites  # the context-parallel exchanges, the forward's tp collectives
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "overrides"), [
    (2, ["parallel.ep=2", "data.micro_batches=4", "train.recompute=full", "parallel.dispatch_chunks=2"]),
    (4, ["parallel.pp=2", "parallel.ep=2", "data.micro_batches=4", "parallel.expert_dispatch=node",
         "parallel.ranks_per_node=1"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "model.mla.num_heads=4", "parallel.cp_mla=latent",
         "data.micro_batches=2"]),
], ids=["ep2-recompute-full-2-chunks", "pp2xep2-by-node", "cp2xtp2xep2-latent"])
def test_paired_step_matches_single_process_float64(tmp_path, world_size, overrides):
    assert_layout_matches_single_process(tmp_path, world_size, [PAIRED, *overrides], worker=paired_worker)


@pytest.mark.timeout(300)
def test_paired_step_is_bitwise_the_unpaired_under_bf16(tmp_path):
    layout = ["parallel.ep=2", "data.micro_batches=4", "train.recompute=full", "parallel.dispatch_chunks=2"]
    runs = [run_distributed(train_worker, 2, str(tmp_path / name), "bfloat16", [*layout, *extra])
            for name, extra in (("unpaired", []), ("paired", [PAIRED]))]
    (losses, state, *_), (paired_losses, paired_state, *_) = runs
    assert paired_losses == losses
    assert state.keys() == paired_state.keys()
    for name, tensor in state.items():
        assert torch.equal(paired_state[name], tensor), name
