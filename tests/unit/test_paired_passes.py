"""The pair runner (parallel/paired_passes.py) and the paired 1F1B order (training/paired_1f1b.py) without
processes: the turns are taken in the order the passes hand over, errors come back to the caller, the forward's
thread computes under the caller's modes, and the order lets every stage of a pipeline finish."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B

from moe_pretrain.training.paired_1f1b import paired_1f1b_order
from parallel.paired_passes import hand_over, hand_overs, run_paired

CPU = torch.device("cpu")


def test_passes_take_turns_where_they_hand_over():
    log = []

    def forward():
        for step in ("f1", "f2", "f3"):
            log.append(step)
            hand_over()
        return "out"

    def backward():
        for step in ("b1", "b2"):
            log.append(step)
            hand_over()

    before = hand_overs()
    assert run_paired(forward, backward, CPU) == "out"
    # f3's hand-over lets the backward end; the forward then runs on alone.
    assert log == ["f1", "b1", "f2", "b2", "f3"]
    assert hand_overs() - before == 5
    hand_over()  # outside a pair: nothing to hand over to
    assert hand_overs() - before == 5


def test_errors_reach_the_caller():
    def failing_forward():
        hand_over()
        raise ValueError("forward failed")

    backward_ran = []
    with pytest.raises(ValueError, match="forward failed"):
        run_paired(failing_forward, lambda: backward_ran.append(hand_over()), CPU)
    assert backward_ran  # the backward finished before the error was raised

    forward_steps = []

    def long_forward():
        for step in range(3):
            forward_steps.append(step)
            hand_over()

    def failing_backward():
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        run_paired(long_forward, failing_backward, CPU)
    assert forward_steps == [0]  # stopped at its first hand-over after the backward failed


def test_forward_thread_computes_under_the_callers_modes():
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        weight = torch.randn(4, 4, requires_grad=True)
        loss = (weight * 2).sum()
        out = run_paired(lambda: torch.mm(torch.randn(2, 4), weight), loss.backward, CPU)
    assert isinstance(out, FakeTensor) and out.dtype == torch.bfloat16 and out.requires_grad


def _simulate(orders: list[list]) -> int:
    """Run every stage's actions in order as soon as their inputs exist (an action needs its forward input from
    the stage before and its backward's gradient from the stage after); return the rounds taken (a deadlock
    raises)."""
    done, position, rounds = set(), [0] * len(orders), 0
    stages = len(orders)

    def ready(stage, action):
        kind, mb = action.computation_type, action.microbatch_index
        if kind == FORWARD:
            return stage == 0 or (stage - 1, "F", mb) in done
        return (stage, "F", mb) in done and (stage == stages - 1 or (stage + 1, "B", mb) in done)

    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        rounds += 1
        finished = []
        for stage, order in enumerate(orders):
            if position[stage] == len(order):
                continue
            action = order[position[stage]]
            parts = action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)
            if all(ready(stage, part) for part in parts):
                finished += [(stage, "F" if p.computation_type == FORWARD else "B", p.microbatch_index)
                             for p in parts]
                position[stage] += 1
        if not finished:
            raise AssertionError(f"deadlock at {position}")
        done.update(finished)
    return rounds


def test_paired_order():
    F = lambda mb: (FORWARD, mb)  # noqa: E731
    B = lambda mb: (FULL_BACKWARD, mb)  # noqa: E731

    def kinds(order):
        return [tuple((p.computation_type, p.microbatch_index) for p in a.sub_actions)
                if a.computation_type == OVERLAP_F_B else (a.computation_type, a.microbatch_index) for a in order]

    # One warm-up forward more than 1F1B's on every stage, so the last stage pairs F(i + 1) with B(i).
    assert kinds(paired_1f1b_order(0, 2, 4)) == [F(0), F(1), (F(2), B(0)), (F(3), B(1)), B(2), B(3)]
    assert kinds(paired_1f1b_order(1, 2, 4)) == [F(0), (F(1), B(0)), (F(2), B(1)), (F(3), B(2)), B(3)]
    assert kinds(paired_1f1b_order(0, 1, 3)) == [F(0), (F(1), B(0)), (F(2), B(1)), B(2)]
    for stages, micro_batches in ((2, 4), (4, 8), (4, 64), (4, 3)):
        orders = [paired_1f1b_order(s, stages, micro_batches) for s in range(stages)]
        for order in orders:
            parts = [p for a in order for p in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]
            assert sorted((p.computation_type, p.microbatch_index) for p in parts) == sorted(
                [F(mb) for mb in range(micro_batches)] + [B(mb) for mb in range(micro_batches)])
        _simulate(orders)


def test_the_plan_holds_one_micro_batch_more_in_flight_when_paired():
    """Stage p of a 1F1B pipeline keeps pp - p micro-batches' activations; paired, its forward runs while the
    backward beside it still holds its own: pp - p + 1 (at most the step's micro-batches)."""
    from dataclasses import replace

    from moe_pretrain.config import load_config
    from moe_pretrain.config.stage import resolve_stages
    from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout

    flights = {}
    for paired in (False, True):
        cfg = load_config(["configs/full.yaml", "configs/stages/full.yaml"],
                          [f"parallel.overlap_micro_batches={str(paired).lower()}"])
        stage = resolve_stages(cfg)[0]
        for micro_batches in (64, 4):
            ranks = MemoryPlanner(cfg).stage(RunLayout(2048, 4, 4, 128),
                                             replace(stage, micro_batches=micro_batches))["ranks"]
            flights[paired, micro_batches] = [rank["in_flight"] for rank in ranks]
    assert flights[False, 64] == [4, 3, 2, 1] and flights[True, 64] == [5, 4, 3, 2]
    assert flights[True, 4] == [4, 4, 3, 2]
