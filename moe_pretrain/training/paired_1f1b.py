"""1F1B with each steady-state forward run beside a backward (parallel.overlap_micro_batches).

Megatron-core's combined 1F1B: in the steady state a stage runs the forward of one micro-batch and the
backward of an earlier one as a pair (parallel/paired_passes.py), each pass's expert all-to-alls in flight
while the other computes. Plain 1F1B alternates F(i + pp - 1 - s) and B(i) on stage s, but on the last stage
that is F(i) and B(i), which cannot pair; so every stage here runs one warm-up forward more (pp - s of them),
then pairs F(i + pp - s) with B(i), then the cool-down backwards. The cost is one micro-batch's saved
activations more on each stage. A pair may start once both its inputs have arrived: the forward's activations
from stage s - 1 (sent after that stage's previous action) and the backward's gradients from stage s + 1
(sent after that stage's pair with the same backward), so no stage waits on one that waits on it.

torch.distributed.pipelining runs such a pair as one OVERLAP_F_B action with two sub-actions and a function
registered for it (the DualPipeV schedule's mechanism); the library's runtime posts the pair's receives
before it and its sends after it.
"""

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)

from parallel.paired_passes import run_paired
from parallel.torch_compat import register_pair_runner


def paired_1f1b_order(stage: int, stages: int, micro_batches: int) -> list[_Action]:
    """Stage `stage`'s compute actions: pp - stage forwards, the pairs, the remaining backwards."""
    warm_up = min(stages - stage, micro_batches)
    order = [_Action(stage, FORWARD, j) for j in range(warm_up)]
    for i in range(micro_batches - warm_up):
        order.append(_Action(stage, OVERLAP_F_B, None,
                             (_Action(stage, FORWARD, i + warm_up), _Action(stage, FULL_BACKWARD, i))))
    order += [_Action(stage, FULL_BACKWARD, i) for i in range(micro_batches - warm_up, micro_batches)]
    return order


class Paired1F1B(_PipelineScheduleRuntime):
    """The 1f1b schedule with parallel.overlap_micro_batches: one stage per rank, steady state in pairs."""

    def __init__(self, stages, n_microbatches: int, **kwargs):
        if len(stages) != 1:
            raise ValueError(f"the paired 1f1b schedule runs one stage per rank, not {len(stages)} (parallel.vpp)")
        super().__init__(stages, n_microbatches, **kwargs)
        count = stages[0].group_size
        self.pipeline_order = {rank: paired_1f1b_order(rank, count, n_microbatches) for rank in range(count)}
        self._prepare_schedule_with_comms(self.pipeline_order)
        register_pair_runner(self, self._run_pair)

    def _run_pair(self, action: _Action, ctx) -> None:
        """ctx: the schedule's context of the step (its micro-batches' arguments and targets)."""
        forward_action, backward_action = action.sub_actions
        stage = self._stages[0]
        fwd_mb, bwd_mb = forward_action.microbatch_index, backward_action.microbatch_index
        if not stage.is_first:
            _wait_batch_p2p(self.fwd_recv_ops.pop((stage.stage_index, fwd_mb)))
        if not stage.is_last:
            _wait_batch_p2p(self.bwd_recv_ops.pop((stage.stage_index, bwd_mb)))

        def forward() -> None:
            output = stage.forward_one_chunk(fwd_mb, ctx.arg_mbs[fwd_mb], ctx.kwarg_mbs[fwd_mb])
            self._maybe_compute_loss(stage, output, ctx.target_mbs, fwd_mb)

        def backward() -> None:
            loss = self._maybe_get_loss(stage, bwd_mb)
            self.backward_counter[stage.stage_index] += 1
            stage.backward_one_chunk(bwd_mb, loss=loss, full_backward=True,
                                     last_backward=self.backward_counter[stage.stage_index] == self._n_microbatches)

        run_paired(forward, backward, stage.device)
