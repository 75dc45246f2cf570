"""parallel/stragglers.judge on given window figures: who is named, after how many windows, and who is not; and
the names the step telemetry reports blocked time under."""

import json

from moe_pretrain.training.step_telemetry import group_names
from parallel.state import ContextGroup, ParallelContext, ParallelLayout
from parallel.stragglers import GROUPS, RankIdentity, Streaks, WindowFigures, judge


def identities(nodes=(0, 0, 1, 1), pp=(0, 0, 0, 0), ep_groups=((0, 1), (0, 1), (2, 3), (2, 3))):
    return [RankIdentity(r, f"host{node}", node, r % 2, 0, p, r % 2, r // 2, 0, group)
            for r, (node, p, group) in enumerate(zip(nodes, pp, ep_groups, strict=True))]


def figures(compute, blocked=None, rows=None):
    """One window of one step per rank: step time = compute + blocked (in 'ep')."""
    blocked = blocked or [0.0] * len(compute)
    rows = rows or [100] * len(compute)
    result = []
    for c, b, n in zip(compute, blocked, rows, strict=True):
        waits = dict.fromkeys(GROUPS, 0.0)
        waits["ep"] = b
        result.append(WindowFigures(1, c + b, 0.0, 0.0, waits, n))
    return result


def test_a_slow_rank_is_named_after_its_windows_and_its_victims_are_not():
    ranks, streaks = identities(), Streaks.of(4)
    # rank 2 computes 1.0 s, the others 0.5 s and then wait 0.5 s for it: every step takes 1.0 s everywhere
    window = figures([0.5, 0.5, 1.0, 0.5], blocked=[0.5, 0.5, 0.0, 0.5])
    assert judge(window, ranks, streaks, 0.2, 3).stragglers == []
    assert judge(window, ranks, streaks, 0.2, 3).stragglers == []
    found = judge(window, ranks, streaks, 0.2, 3)
    assert found.stragglers == [2] and found.slow_nodes == [] and found.expert_load == []
    assert found.ratio == [1.0, 1.0, 2.0, 1.0]


def test_the_count_goes_on_after_a_resume_of_the_same_world_and_starts_over_on_another():
    ranks, streaks = identities(), Streaks.of(4)
    window = figures([0.5, 0.5, 1.0, 0.5], blocked=[0.5, 0.5, 0.0, 0.5])
    judge(window, ranks, streaks, 0.2, 3)
    judge(window, ranks, streaks, 0.2, 3)
    resumed = Streaks.of(4)
    resumed.load_state_dict(json.loads(json.dumps(streaks.state_dict())))  # as a checkpoint keeps it
    assert judge(window, ranks, resumed, 0.2, 3).stragglers == [2]  # the third window in a row
    elsewhere = Streaks.of(8)
    elsewhere.load_state_dict(streaks.state_dict())
    assert elsewhere.ranks == [0] * 8


def test_a_window_back_to_normal_resets_the_count():
    ranks, streaks = identities(), Streaks.of(4)
    slow, clean = figures([0.5, 0.5, 1.0, 0.5]), figures([0.5, 0.5, 0.5, 0.5])
    for window in (slow, slow, clean, slow, slow):
        assert judge(window, ranks, streaks, 0.2, 3).stragglers == []
    assert judge(clean, ranks, streaks, 0.2, 3).stragglers == [] and streaks.ranks == [0, 0, 0, 0]


def test_peers_are_the_ranks_of_the_same_pipeline_stage():
    # stage 1's ranks do more work than stage 0's: all within their own stage's median, nobody is slow
    ranks, streaks = identities(pp=(0, 0, 1, 1)), Streaks.of(4)
    found = judge(figures([0.5, 0.5, 1.5, 1.5]), ranks, streaks, 0.2, 1)
    assert found.stragglers == [] and found.ratio == [1.0, 1.0, 1.0, 1.0]


def test_every_rank_of_a_node_slow_names_the_node():
    ranks, streaks = identities(nodes=(0, 0, 1, 1, 2, 2), pp=(0,) * 6,
                                ep_groups=((0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5))), Streaks.of(6)
    found = judge(figures([0.5, 0.5, 1.0, 1.0, 0.5, 0.5]), ranks, streaks, 0.2, 1)
    assert found.slow_nodes == [1] and found.stragglers == [] and found.node_ratio[1] == 2.0  # beside ranks 0, 1, 4, 5


def test_a_node_half_its_stage_is_judged_beside_the_other_nodes():
    """Two nodes: the stage's median (0.75) lies between the slow node's ranks and the others, so each slow rank
    is only 1.33x it, under the threshold; beside the other node's ranks they are 2x, and the node is named after
    its windows in a row."""
    ranks, streaks = identities(), Streaks.of(4)
    window = figures([0.5, 0.5, 1.0, 1.0])
    assert judge(window, ranks, streaks, 0.5, 2).slow_nodes == []
    found = judge(window, ranks, streaks, 0.5, 2)
    assert found.slow_nodes == [1] and found.stragglers == [] and found.node_ratio == {0: 0.5, 1: 2.0}
    assert found.ratio[2] < 1.5  # not a straggler beside its stage's median


def test_a_node_with_one_slow_rank_is_not_named_but_its_rank_is():
    ranks, streaks = identities(nodes=(0, 0, 1, 1, 2, 2), pp=(0,) * 6,
                                ep_groups=((0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5))), Streaks.of(6)
    found = judge(figures([0.5, 0.5, 1.0, 0.5, 0.5, 0.5]), ranks, streaks, 0.2, 1)
    assert found.slow_nodes == [] and found.stragglers == [2]


def test_expert_load_is_reported_as_routing_not_as_a_slow_rank():
    ranks, streaks = identities(), Streaks.of(4)
    # rank 0's experts receive 3x its group's other rank: it computes more, for a reason that is not its hardware
    found = judge(figures([1.0, 0.5, 0.5, 0.5], rows=[300, 100, 100, 100]), ranks, streaks, 0.2, 1)
    assert found.expert_load == [0] and found.stragglers == [] and found.load[0] == 1.5


def test_a_balanced_run_names_nobody():
    ranks, streaks = identities(), Streaks.of(4)
    for _ in range(5):
        found = judge(figures([0.50, 0.52, 0.49, 0.51]), ranks, streaks, 0.2, 3)
        assert found.stragglers == [] and found.slow_nodes == [] and found.expert_load == []


def test_blocked_time_is_reported_under_the_coarse_names_of_the_contexts_groups():
    """The node dispatch's two expert groups count as ep, tp x dp as dp, every context-parallel size as cp;
    a group playing two roles takes its first name (tp here)."""
    tp, rail, node, tp_dp, cp2, cp4 = (object() for _ in range(6))
    ctx = ParallelContext(ParallelLayout(world_size=1), tp_group=tp, ep_rail_group=rail, ep_node_group=node,
                          tp_dp_group=tp_dp, edp_group=tp,
                          context_groups={2: ContextGroup(2, cp2, 0, 0, 1), 4: ContextGroup(4, cp4, 0, 0, 1)})
    names = group_names(ctx)
    assert names == {tp: "tp", rail: "ep", node: "ep", tp_dp: "dp", cp2: "cp", cp4: "cp"}
    assert set(names.values()) <= set(GROUPS)
