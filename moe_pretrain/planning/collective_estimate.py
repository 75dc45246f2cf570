"""One collective's time as NCCL reaches it (the dry run's estimate), from a calibration table
(planning/calibration.py), beside the bound's bytes at line rate (planning/step_time.collective_seconds).

The bytes a GPU sends (step_time.sent_share) cross NVLink, the NIC or both (step_time.link_bytes) at each
link's achievable fraction of its line rate for the collective's kind (ring, all-to-all, point to point), after
a latency in NCCL's own model (src/graph/tuning.cc): a base, then each step of the ring on the link it crosses
(an all-gather or reduce-scatter of n ranks on k nodes takes n - 1 steps, k - 1 of them between nodes; an
all-reduce twice that); an all-to-all pays a time per peer instead. The physical links it occupies are named,
so the timeline queues every collective that crosses a link behind the others on it, whatever their group.
"""

import math

from moe_pretrain.config import ClusterConfig
from moe_pretrain.planning.calibration import Calibration
from moe_pretrain.planning.step_time import link_bytes, sent_share


def collective_kind(op: str) -> str:
    """The calibration's kind of a c10d op: 'alltoall', 'p2p' (a send, a broadcast) or 'ring'."""
    if op.startswith("alltoall"):
        return "alltoall"
    if op.startswith(("send", "recv", "broadcast")):
        return "p2p"
    return "ring"


def collective_estimate(cal: Calibration, op: str, payload: int, ranks: list[int], cluster: ClusterConfig
                        ) -> tuple[float, tuple[str, ...]]:
    """(seconds, the physical links it occupies: 'nvlink', 'nic') of `payload` bytes of c10d op `op` over a group
    of `ranks` (global numbers); a group of one, or a receive (its sender counts it), takes none."""
    n = len(ranks)
    shared = sent_share(op, n)
    if n < 2 or shared == 0.0:
        return 0.0, ()
    kind = collective_kind(op)
    nvlink_bytes, nic_bytes = link_bytes(payload * shared, ranks, cluster, all_to_all=kind == "alltoall")
    nodes = len({r // cluster.gpus_per_node for r in ranks})
    nvlink, nic = cal.links["nvlink"], cal.links["nic"]
    if kind == "alltoall":
        latency = (nic if nodes > 1 else nvlink).base_latency_s + (n - 1) * cal.alltoall_peer_s
    elif kind == "p2p":
        latency = (nic if nodes > 1 else nvlink).step_latency_s
    else:
        rounds = 2 if op.startswith("allreduce") else 1
        between = rounds * (nodes - 1)
        latency = nvlink.base_latency_s + (rounds * (n - 1) - between) * nvlink.step_latency_s \
            + between * nic.step_latency_s
        if rounds == 2 and nodes > 1:
            tree = nvlink.base_latency_s + 2 * ((n // nodes - 1) * nvlink.step_latency_s
                                                + math.log2(nodes) * nic.step_latency_s)
            latency = min(latency, tree)
    seconds = max(nvlink_bytes / (cluster.nvlink_gb_s * 1e9 * nvlink.fraction[kind]),
                  nic_bytes / (cluster.nic_gb_s * 1e9 * nic.fraction[kind]))
    links = tuple(name for name, size in (("nvlink", nvlink_bytes), ("nic", nic_bytes)) if size)
    return latency + seconds, links
