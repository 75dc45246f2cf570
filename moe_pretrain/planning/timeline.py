"""A step's timeline on a target GPU: which collectives compute hides, from the order the code issues things.

The dry run's meters report every compute op (planning/op_census.py, its roofline time) and every collective
(planning/collective_traffic.py, its time on its group's link) as the step issues them. Here they are laid
out as a GPU runs them: compute ops one after another on one stream; each collective starts when it is
issued and its group's link is free (one queue per group) and takes its time; the compute stream waits for
a collective where the code waits for it: a synchronous one at once, an asynchronous one
(parallel/collectives.Pending) where it is waited for. A collective is hidden only behind compute issued
while it is in flight. What is still in flight when the step's compute ends (the sharded optimizer's
parameter all-gathers) runs into the next step's first forward, where each layer waits for its own; it
counts as hidden for the length of one micro-batch's forward, and beyond that as exposed.

Waits inside a pair of passes (parallel/paired_passes.py: a forward beside a backward) are also filed apart:
a cut step runs fewer pairs than the whole step, whose warm-up and cool-down run the same unpaired passes, so
the two kinds scale differently to the stage's micro-batches (plan_step_time.traced_stage_step).
"""

import collections
from dataclasses import dataclass

from moe_pretrain.planning.step_time import BACKWARD_SHARE
from parallel.collectives import CollectiveObserver
from parallel.paired_passes import pair_running


@dataclass
class _Collective:
    group: str
    end: float
    waited: bool = False


class Timeline(CollectiveObserver):
    """compute(seconds) and issue(group, seconds) in the order the step runs them; started() / waited(token)
    from parallel/collectives.observing for the asynchronous ones."""

    def __init__(self):
        self.compute_s = 0.0
        """The compute stream's clock: the compute issued so far, and its waits."""
        self.busy_s = 0.0
        """The compute alone."""
        self.link_s: collections.Counter = collections.Counter()
        """Per group, its collectives' time on their links."""
        self.link_free: dict[str, float] = {}
        self.collectives: list[_Collective] = []
        self.exposed_s: collections.Counter = collections.Counter()
        """Per group, how long the compute stream waited for its collectives."""
        self.exposed_paired_s: collections.Counter = collections.Counter()
        """Of exposed_s, the waits while a pair of passes ran."""
        self._unresolved: int | None = None
        """The last collective issued, until it is known whether the code waits for it at once."""

    def _resolve(self) -> None:
        """The last collective is synchronous unless started() claimed it: the compute waits for it now."""
        if self._unresolved is not None:
            index, self._unresolved = self._unresolved, None
            self._wait(index)

    def _wait(self, index: int) -> None:
        collective = self.collectives[index]
        if not collective.waited:
            collective.waited = True
            if collective.end > self.compute_s:
                self.exposed_s[collective.group] += collective.end - self.compute_s
                if pair_running():
                    self.exposed_paired_s[collective.group] += collective.end - self.compute_s
                self.compute_s = collective.end

    def compute(self, seconds: float) -> None:
        self._resolve()
        self.compute_s += seconds
        self.busy_s += seconds

    def issue(self, group: str, seconds: float) -> None:
        self._resolve()
        self.link_s[group] += seconds
        start = max(self.compute_s, self.link_free.get(group, 0.0))
        self.link_free[group] = start + seconds
        self.collectives.append(_Collective(group, start + seconds))
        self._unresolved = len(self.collectives) - 1

    def started(self) -> int | None:
        """The collective just issued is asynchronous: its token for waited() (None: no collective was issued,
        as for a group of one)."""
        index, self._unresolved = self._unresolved, None
        return index

    def waited(self, token: int | None) -> None:
        self._resolve()
        if token is not None:
            self._wait(token)

    def finish(self, micro_batches: int) -> float:
        """The step's time: its compute and waits, and what is still in flight beyond the next step's first
        micro-batch's forward (module docstring)."""
        self._resolve()
        hidden_until = self.compute_s + (1 - BACKWARD_SHARE) * self.busy_s / micro_batches
        for collective in self.collectives:
            if not collective.waited:
                collective.waited = True
                self.exposed_s[collective.group] += max(0.0, collective.end - hidden_until)
        return self.busy_s + sum(self.exposed_s.values())
