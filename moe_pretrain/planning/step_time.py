"""A step's time on a target GPU and fabric, predicted from what the dry run counted (planning/dry_run.py).

Compute: each op that launches takes its roofline bound, the larger of its FLOPs over the GPU's dense peak
and the bytes it reads and writes over its memory bandwidth (planning/op_census.py adds them up op by op);
ops run one after another on one stream. Communication: each collective's payload, times what a ring or an
all-to-all sends of it per GPU ((n - 1) / n of a gathered or scattered tensor, twice that for an
all-reduce), over the link it crosses: NVLink when every rank of its group shares a node, else the NIC (an
all-to-all sends the share meant for its own node's GPUs over NVLink, the rest over the NIC, at once).
Overlap, in the plan (predict): the data-parallel groups' traffic (the sharded optimizer's bucketed
reduce-scatters, started during the last backward, and its parameter all-gathers) is hidden behind the
backward's compute, two thirds of the step's, as far as that lasts; every other collective (tensor
parallel, the experts' all-to-alls, pipeline sends) waits in line with the compute that needs its result.
The dry run does not assume this: it lays its step out on a timeline (planning/timeline.py), where a
collective hides only behind compute issued while it is in flight. A pipeline's step adds
its schedule's bubble to its slowest rank's time (pipeline_step_seconds). What this cannot tell: kernels'
real efficiency (the roofline is a bound), contention, stragglers.
"""

from dataclasses import dataclass

from moe_pretrain.config import ClusterConfig
from moe_pretrain.gpus import GpuSpec

OVERLAPPED_GROUPS = ("dp", "edp", "tp x dp")
"""Groups whose traffic the code issues asynchronously, overlapping the backward: the sharded optimizer's
buckets (parallel/optimizer.py), the sequence-parallel replicated parameters' over tp x dp among them."""
BACKWARD_SHARE = 2 / 3
"""The backward's share of a step's compute (twice the forward's FLOPs)."""


def sent_share(op: str, n: int) -> float:
    """Bytes a GPU sends per byte of a collective's payload (collective_traffic.py's payload) in a group of n."""
    if n < 2:
        return 0.0
    if op.startswith("allreduce"):
        return 2 * (n - 1) / n
    if op.startswith(("allgather", "_allgather", "reduce_scatter", "_reduce_scatter", "alltoall")):
        return (n - 1) / n
    if op.startswith(("send", "broadcast")):
        return 1.0
    return 0.0  # a receive (its sender counts the bytes, and the link is full duplex), a barrier


def link_bytes(sent: float, ranks: list[int], cluster: ClusterConfig, all_to_all: bool = False
               ) -> tuple[float, float]:
    """(over NVLink, over the NIC) of `sent` bytes from one GPU of a group of `ranks` (their global numbers):
    all over NVLink when the group shares a node, else the NIC; an all-to-all sends its own node's share over
    NVLink."""
    n = len(ranks)
    if n < 2:
        return 0.0, 0.0
    nodes = {r // cluster.gpus_per_node for r in ranks}
    if len(nodes) == 1:
        return sent, 0.0
    if all_to_all:
        local = (n / len(nodes) - 1) / (n - 1)  # the group's share on this GPU's node, itself excluded
        return sent * local, sent * (1 - local)
    return 0.0, sent


def link_seconds(sent: float, ranks: list[int], cluster: ClusterConfig, all_to_all: bool = False) -> float:
    """Time to send `sent` bytes from one GPU of a group of `ranks` on its links (link_bytes), both at once."""
    nvlink, nic = link_bytes(sent, ranks, cluster, all_to_all)
    return max(nvlink / (cluster.nvlink_gb_s * 1e9), nic / (cluster.nic_gb_s * 1e9))


def collective_seconds(op: str, payload: int, ranks: list[int], cluster: ClusterConfig) -> float:
    """Time of `payload` bytes of collective `op` over a group of `ranks`."""
    return link_seconds(payload * sent_share(op, len(ranks)), ranks, cluster, op.startswith("alltoall"))


def pipeline_step_seconds(rank_step_s: float, pp: int, vpp: int, micro_batches: int) -> float:
    """A step of the slowest pipeline rank's time `rank_step_s` (its micro-batches back to back), with the
    1F1B schedule's bubble: pp - 1 micro-batch slots of warm-up and cool-down, 1 / vpp as long interleaved."""
    return rank_step_s * (1 + (pp - 1) / (vpp * micro_batches))


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    collective_s: dict[str, float]
    """Per group, its collectives' time on their links."""
    exposed_s: float
    """The collectives' time not hidden behind compute."""
    step_s: float
    mfu: float
    """Model FLOPs (without recomputation) per GPU over step_s x peak."""


def predict(compute_s: float, collective_s: dict[str, float], model_flops: float, gpu: GpuSpec) -> StepTime:
    """Combine compute and collectives by the overlap the code issues (module docstring)."""
    overlapped = sum(t for group, t in collective_s.items() if group in OVERLAPPED_GROUPS)
    serial = sum(t for group, t in collective_s.items() if group not in OVERLAPPED_GROUPS)
    exposed = serial + max(0.0, overlapped - BACKWARD_SHARE * compute_s)
    step = compute_s + exposed
    return StepTime(compute_s, collective_s, exposed, step, model_flops / (step * gpu.peak_flops) if step else 0.0)
