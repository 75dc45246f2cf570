"""The dry run's step timeline (planning/timeline.py) on hand-made steps: what it hides and what it exposes."""

import pytest
import torch

from moe_pretrain.planning.step_time import BACKWARD_SHARE
from moe_pretrain.planning.timeline import Timeline
from parallel.paired_passes import hand_over, run_paired


def test_a_synchronous_collective_is_waited_for_at_once():
    timeline = Timeline()
    timeline.compute(1.0)
    timeline.issue("ep", 2.0)
    timeline.compute(1.0)
    assert timeline.finish(micro_batches=1) == 4.0 and timeline.exposed_s == {"ep": 2.0}


def test_an_asynchronous_collective_hides_behind_the_compute_issued_while_it_is_in_flight():
    timeline = Timeline()
    timeline.issue("dp", 3.0)
    early = timeline.started()
    timeline.compute(1.0)  # only this much runs while it is in flight
    timeline.waited(early)
    timeline.issue("dp", 1.0)
    hidden = timeline.started()
    timeline.compute(5.0)
    timeline.waited(hidden)
    assert timeline.finish(micro_batches=1) == 8.0 and timeline.exposed_s == {"dp": 2.0}


def test_collectives_of_one_group_queue_on_its_link_and_other_groups_do_not_wait():
    timeline = Timeline()
    tokens = []
    for group in ("dp", "dp", "ep"):
        timeline.issue(group, 2.0)
        tokens.append(timeline.started())
    timeline.compute(1.0)
    for token in tokens:
        timeline.waited(token)
    # dp's second starts when its first ends (t = 2, ends at 4); ep's runs beside them (ends at 2)
    assert timeline.finish(micro_batches=1) == 4.0 and timeline.exposed_s == {"dp": 3.0}


def test_what_is_in_flight_at_the_end_runs_into_the_next_steps_first_forward():
    timeline = Timeline()
    timeline.compute(6.0)
    timeline.issue("dp", 0.5)
    timeline.started()  # the parameter all-gathers: waited for in the next step
    assert timeline.finish(micro_batches=2) == 6.0  # hidden behind the next forward: 1/3 of 3 s
    late = Timeline()
    late.compute(6.0)
    late.issue("dp", 2.5)
    late.started()
    assert late.finish(micro_batches=2) == pytest.approx(6.0 + 2.5 - (1 - BACKWARD_SHARE) * 3.0)


def test_waits_inside_a_pair_of_passes_are_filed_apart():
    """A forward's exchange in flight while the backward beside it computes (parallel/paired_passes.py) hides
    behind that compute; what is left of it is exposed inside the pair, and filed so."""
    timeline = Timeline()

    def forward():
        timeline.issue("ep", 3.0)
        token = timeline.started()
        hand_over()  # the backward computes 2 s meanwhile
        timeline.waited(token)

    def backward():
        timeline.compute(2.0)
        hand_over()

    run_paired(forward, backward, torch.device("cpu"))
    timeline.issue("ep", 1.0)  # alone, and waited for at once
    timeline.compute(1.0)
    assert timeline.finish(micro_batches=1) == 5.0
    assert timeline.exposed_s == {"ep": 2.0} and timeline.exposed_paired_s == {"ep": 1.0}


def test_the_estimates_stream_idles_while_the_host_issues_short_kernels_and_a_host_read_drains_it():
    """Hand-worked: the host issues a launch every 5 us; kernels of 1 us run one per issue (the stream idles 4 us
    of each 5 after the first); kernels of 100 us run back to back ahead of the host until a host read makes it
    wait for the stream, after which the next kernel waits for its issue again."""
    host_bound = Timeline(host_issue_s=5e-6)
    for _ in range(10):
        host_bound.compute(1e-6)
    assert host_bound.finish(micro_batches=1) == pytest.approx(51e-6)
    assert host_bound.host_wait_s == pytest.approx(41e-6)
    gpu_bound = Timeline(host_issue_s=1e-6)
    for _ in range(3):
        gpu_bound.compute(100e-6)
    gpu_bound.host_read()  # the host now stands at 301 us: the stream's end
    gpu_bound.compute(1e-6)  # issued at 302 us
    assert gpu_bound.finish(micro_batches=1) == pytest.approx(303e-6)
    assert gpu_bound.host_wait_s == pytest.approx(2e-6)  # 1 us before the first kernel, 1 us after the read


def test_the_estimates_collectives_queue_on_the_physical_link_whatever_their_group():
    """Two asynchronous collectives of different groups on the NIC: the second starts when the first ends; the
    bound's queues are per group, so there they run side by side."""
    for queues, step in (((), 2.0), (("nic",), 4.0)):
        timeline = Timeline()
        tokens = []
        for group in ("ep", "dp"):
            timeline.issue(group, 2.0, queues)
            tokens.append(timeline.started())
        timeline.compute(1.0)
        for token in tokens:
            timeline.waited(token)
        assert timeline.finish(micro_batches=1) == step


def test_compute_beside_a_collective_in_flight_runs_slower_by_the_sms_it_holds():
    timeline = Timeline(collective_sm_share=0.1)
    timeline.issue("ep", 0.9, ("nic",))
    token = timeline.started()
    timeline.compute(1.8)  # 0.9 s of it beside the exchange: 0.1 s slower
    timeline.waited(token)
    assert timeline.contention_s == pytest.approx(0.1)
    assert timeline.finish(micro_batches=1) == pytest.approx(1.9)


def test_waits_between_two_pairs_are_the_steady_states_and_filed_with_the_pairs():
    """A send waited for after the first pair and before the second (the pipeline passing a pair's results on)
    happens once a pair, as the whole step's steady state does: it is filed with the pairs' waits. The warm-up's
    and the cool-down's are not."""
    timeline = Timeline()

    def wait_for(seconds: float) -> None:
        timeline.issue("pp", seconds)
        timeline.compute(0.0)

    def pair() -> None:
        run_paired(lambda: hand_over(), lambda: (timeline.compute(1.0), hand_over()), torch.device("cpu"))

    wait_for(1.0)  # warm-up
    pair()
    wait_for(2.0)  # between the pairs
    pair()
    wait_for(4.0)  # cool-down
    assert timeline.finish(micro_batches=3) == 9.0
    assert timeline.exposed_s == {"pp": 7.0} and timeline.exposed_paired_s == {"pp": 2.0}
