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
