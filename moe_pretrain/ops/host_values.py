"""The values a training step reads from the device on the host, and the dry run's stand-ins for those the
model's arithmetic decides.

A step reads the device in few places (planning/host_reads.py counts them): the document bounds, which the
data decides; the expert-parallel all-to-all's split sizes and the experts' row counts, which the routing
decides; and the step's logged scalars. The dry run (launch/dryrun.py) plays a rank under a fake-tensor
mode: tensors hold shapes, no values. It hands in AssumedHostValues where a run has HostValues:
- what the data decides is computed for real (`data_values`: the document layout from the real loader's
  document ids), so the bounds, masks and per-document loops are the run's own;
- what the routing decides comes from a stated assumption (planning/assumed_values.py: a load vector over
  the experts, the same on every rank, so each rank's receives are the others' sends); the experts each
  token is sent to follow it too (`routed`), so a real run under the same assumption routes alike;
- the logged scalars are taken as finite, so the update runs as on a good step.
HostValues' reads, and AssumedHostValues' on real tensors, are the plain reads they stand for.
"""

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.overrides import handle_torch_function


class Assumptions(Protocol):
    def routing(self, tokens: int, k: int, experts: int, device: torch.device) -> torch.Tensor:
        """[tokens, k] int64 experts of each token, distinct in each row, routed as split_sizes says."""

    def split_sizes(self, rows: int, ep: int, rank: int, experts: int) -> tuple[list[int], list[int]]:
        """(rows sent to each expert-parallel rank, rows received from each) of `rows` routed copies."""

    def node_split_sizes(self, tokens: int, k: int, experts: int, nodes: int, ranks_per_node: int, rank: int
                         ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """The node dispatch's (rail, node) exchanges' (sent to, received from) each peer: parallel/node_dispatch.py."""

    def expert_rows(self, rows: int, experts: int) -> list[int]:
        """Rows of each of `experts` consecutive experts among `rows`."""

    def scalars(self, count: int) -> list[float]:
        """The values of `count` logged scalars."""


class HostValues:
    """How a step reads device values on the host as a real run does: every read a plain tolist, the routing
    as the router chose, the data's values computed as given. One object handed to what reads: the modules get
    it with their kernels (gpu_kernels/choice.Kernels.host), the dispatchers from the parallel set-up, the
    trainer from the kernels it was built with. The dry run hands in AssumedHostValues instead."""

    def routed(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The experts each token goes to ([m, k]): topk_idx."""
        return topk_idx

    def data_values(self) -> contextlib.AbstractContextManager:
        """Around what the data alone decides (from real input tensors): computed as real tensors."""
        return contextlib.nullcontext()

    def _read(self, values: torch.Tensor, what: str, answer: Callable[[Assumptions], list]) -> list:
        if is_fake(values):
            raise RuntimeError(f"{what}: a host read of a fake tensor outside a dry run (ops/host_values."
                               "AssumedHostValues)")
        return values.tolist()

    def split_sizes(self, send_counts: torch.Tensor, receive_counts: torch.Tensor, rows: list[int], rank: int
                    ) -> list[tuple[list[int], list[int]]]:
        """Per chunk of a MoE layer's tokens, (rows sent to, rows received from) each rank of the expert-parallel
        all-to-all, from the counts [chunks, ranks, local experts] this rank (`rank` of the group, sending
        rows[c] routed copies of chunk c) sends and receives, read at once."""
        _, ep, local = send_counts.shape
        values = self._read(torch.stack([send_counts.sum(2), receive_counts.sum(2)], 1),
                            "the all-to-all's split sizes",
                            lambda a: [list(a.split_sizes(n, ep, rank, ep * local)) for n in rows])
        return [(send, receive) for send, receive in values]

    def node_split_sizes(self, rail_send: torch.Tensor, rail_receive: torch.Tensor, node_send: torch.Tensor,
                         node_receive: torch.Tensor, tokens: list[int], k: int, experts: int, rank: int
                         ) -> list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]]:
        """Per chunk of a MoE layer's tokens, ((rows sent to, received from) each node, (copies sent to, received
        from) each rank of the node) of the node dispatch (parallel/node_dispatch.py) of expert-parallel `rank`,
        from its counts on the device ([chunks, nodes] and [chunks, ranks of a node]), read at once (assumed:
        of tokens[c] x k copies in chunk c on every rank)."""
        nodes, per_node = rail_send.shape[1], node_send.shape[1]

        def assumed(a: Assumptions) -> list[list[int]]:
            chunks = [a.node_split_sizes(n, k, experts, nodes, per_node, rank) for n in tokens]
            return [[*rail_out, *rail_in, *node_out, *node_in] for (rail_out, rail_in), (node_out, node_in) in chunks]

        values = self._read(torch.cat([rail_send, rail_receive, node_send, node_receive], 1),
                            "the node dispatch's split sizes", assumed)
        return [((v[:nodes], v[nodes:2 * nodes]), (v[2 * nodes:2 * nodes + per_node], v[2 * nodes + per_node:]))
                for v in values]

    def expert_rows(self, counts: torch.Tensor, rows: int) -> list[int]:
        """counts.tolist(): the rows of each expert, `rows` in all."""
        return self._read(counts, "the experts' row counts", lambda a: a.expert_rows(rows, counts.shape[0]))

    def scalar_list(self, values: torch.Tensor) -> list[float]:
        """values.tolist() of a step's 1-D logged scalars."""
        return self._read(values, "the step's scalars", lambda a: a.scalars(values.numel()))


READ = HostValues()
"""A real run's reads."""


class AssumedHostValues(HostValues):
    """The dry run's reads: a fake tensor's values come from the assumptions (the read itself is still issued,
    for the meters); the routing follows them on real tensors too, so that a real run traced beside a dry run
    (planning/dry_run.py) routes, sends and computes as the dry run assumes; the data's values are computed
    outside the fake-tensor mode."""

    def __init__(self, assumptions: Assumptions):
        self.assumptions = assumptions

    def routed(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        tokens, k = topk_idx.shape
        return self.assumptions.routing(tokens, k, num_experts, topk_idx.device)

    def data_values(self) -> contextlib.AbstractContextManager:
        return unset_fake_temporarily()

    def _read(self, values: torch.Tensor, what: str, answer: Callable[[Assumptions], list]) -> list:
        if not is_fake(values):
            return values.tolist()
        _issue_read(values)
        return answer(self.assumptions)


def _issue_read(values: torch.Tensor) -> None:
    """Issue the tolist a real run makes here, which a fake tensor refuses, through the torch-function modes:
    host-read meters (planning/host_reads.py) see the dry run's reads where the run's are."""
    # A fake tensor refuses the read (the point): RuntimeError under a torch-function mode (the meters' and
    # fake tensors' own refusals), AttributeError with none active. Any other error is a fault of ours.
    with contextlib.suppress(RuntimeError, AttributeError):
        handle_torch_function(torch.Tensor.tolist, (values,), values)
