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

Waits inside a pair of passes (parallel/paired_passes.py: a forward beside a backward), and those between one
pair and the next (the pipeline's sends of a pair's results), are also filed apart: a cut step runs fewer pairs
than the whole step, whose warm-up and cool-down run the same unpaired passes, so the two kinds scale
differently to the stage's micro-batches (plan_step_time.traced_stage_step).

The bound's timeline is the above. The estimate's (planning/calibration.py) adds what a GPU run meets: the host
issues each launch and collective in host_issue_s, and the GPU cannot start a kernel the host has not issued
(time it then idles is host_wait_s); a host read of a device value (planning/host_reads.py) drains the queue,
the host waiting for the stream; collectives queue on the physical links they cross (NVLink, the NIC), not per
group; and compute issued while a collective is in flight runs slower by the SMs its kernels hold
(contention_s).
"""

import collections
from dataclasses import dataclass

from moe_pretrain.planning.step_time import BACKWARD_SHARE
from parallel.collectives import CollectiveObserver
from parallel.paired_passes import pair_running, pairs_run


@dataclass
class _Collective:
    group: str
    end: float
    waited: bool = False


class Timeline(CollectiveObserver):
    """compute(seconds) and issue(group, seconds) in the order the step runs them; started() / waited(token)
    from parallel/collectives.observing for the asynchronous ones."""

    def __init__(self, host_issue_s: float = 0.0, collective_sm_share: float = 0.0):
        """host_issue_s, collective_sm_share: the estimate's host and contention (module docstring); 0 for the
        bound."""
        self.host_issue_s, self.sm_share = host_issue_s, collective_sm_share
        self.host_s = 0.0
        """The host's clock: where it has issued to."""
        self.host_wait_s = 0.0
        """The time the stream idled for the host to issue its next launch."""
        self.contention_s = 0.0
        """The compute's slowdown beside collectives in flight."""
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
        """Of exposed_s, the waits while a pair of passes ran, and (from finish()) those between two pairs."""
        self._pairs_before = pairs_run()
        self._unpaired: list[tuple[str, float, int]] = []
        """Waits outside a pair: (group, seconds, the pairs run before it)."""
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
                wait = collective.end - self.compute_s
                self.exposed_s[collective.group] += wait
                if pair_running():
                    self.exposed_paired_s[collective.group] += wait
                else:
                    self._unpaired.append((collective.group, wait, pairs_run() - self._pairs_before))
                self.compute_s = collective.end

    def _issued(self) -> None:
        """The host issues one more launch; the stream starts it no earlier."""
        self.host_s += self.host_issue_s
        if self.host_s > self.compute_s:
            self.host_wait_s += self.host_s - self.compute_s
            self.compute_s = self.host_s

    def compute(self, seconds: float) -> None:
        self._resolve()
        self._issued()
        if self.sm_share and self.link_free:
            beside = min(seconds, max(self.link_free.values()) - self.compute_s)
            if beside > 0:
                slower = beside * self.sm_share / (1 - self.sm_share)
                self.contention_s += slower
                self.compute_s += slower
        self.compute_s += seconds
        self.busy_s += seconds

    def issue(self, group: str, seconds: float, queues: tuple[str, ...] = ()) -> None:
        """A collective of `group` taking `seconds` on the queues it occupies (the bound: its group's)."""
        self._resolve()
        self._issued()
        self.link_s[group] += seconds
        queues = queues or (group,)
        start = max(self.compute_s, *(self.link_free.get(queue, 0.0) for queue in queues))
        for queue in queues:
            self.link_free[queue] = start + seconds
        self.collectives.append(_Collective(group, start + seconds))
        self._unresolved = len(self.collectives) - 1

    def host_read(self) -> None:
        """The host reads a device value: it waits for the stream to drain (the estimate; free for the bound)."""
        if self.host_issue_s:
            self._resolve()
            self.host_s = max(self.host_s, self.compute_s)

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
        pairs = pairs_run() - self._pairs_before
        for group, wait, before in self._unpaired:
            if 0 < before < pairs:  # after one pair and before the next: the steady state's, as its pairs'
                self.exposed_paired_s[group] += wait
        hidden_until = self.compute_s + (1 - BACKWARD_SHARE) * self.busy_s / micro_batches
        for collective in self.collectives:
            if not collective.waited:
                collective.waited = True
                self.exposed_s[collective.group] += max(0.0, collective.end - hidden_until)
        return self.busy_s + sum(self.exposed_s.values()) + self.host_wait_s + self.contention_s
