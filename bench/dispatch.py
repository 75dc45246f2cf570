"""Expert dispatch: bytes on the wire against the minimum, and MoE layer time at ep 1, 2, 4; flat against by
node (parallel.expert_dispatch=node) at ep 4 as 2 "nodes" of 2 processes.

Run: .venv/bin/python bench/dispatch.py [--tokens 2048 --repeats 5]

For each expert-parallel size, every rank routes its own tokens through one smoke-size LatentMoE
(d=128, 16 experts, top-4, latent 64) and runs forward + backward. Printed per size:
- bytes sent per token, measured from the splits handed to all_to_all_single, against the minimum
  (tokens x top-k copies whose expert lives on another rank, x latent width x dtype bytes), as a
  ratio (1.00 = nothing but off-rank latent rows travels), and against what hidden-width rows would
  cost (the LatentMoE design's saving, l / d);
- median forward + backward time, and its ratio to ep 1 measured in the same run (2-core machines:
  more processes share the same cores, so this measures overhead, not speed-up);
- at ep 4 flat and by node: the bytes each sends across node boundaries per token (flat: its copies whose
  expert is on another node; by node: the dispatcher's count), the ratio node / flat, and the time ratio;
- by node in 2 chunks run as a pipeline (parallel.dispatch_chunks=2) against 1: the time ratio.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.config import MoEConfig
from moe_pretrain.model.moe import LatentMoE
from parallel.collectives import all_reduce_sum
from parallel.node_groups import expert_node_groups
from parallel.parallelize import describe_parameters, materialize, shard_parameters
from parallel.plan import ShardingPlan
from parallel.state import ParallelContext, ParallelLayout

D = 128
MOE = MoEConfig(num_experts=16, top_k=4, expert_intermediate=64, latent_size=64, num_shared_experts=2,
                shared_intermediate=64)


class _Holder(torch.nn.Module):
    """One MoE layer under the path the sharding plan names (layers.1.mlp), with the routers() hook."""

    def __init__(self, moe: LatentMoE):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"1": torch.nn.Module()})
        self.layers["1"].mlp = moe

    def routers(self):
        return {1: self.layers["1"].mlp.router}


def measure(rank: int, world_size: int, tokens: int, repeats: int, ranks_per_node: int = 0,
            by_node: bool = False, chunks: int = 1) -> dict:
    """One MoE layer's forward + backward on this rank, "nodes" of ranks_per_node (0: one node); by_node:
    dispatched by node; its tokens in `chunks` run as a pipeline."""
    with torch.device("meta"):
        holder = _Holder(LatentMoE(D, MOE, norm_eps=1e-5, init_std=0.02, out_std=0.02))
    parameters = describe_parameters(holder)
    ctx = ParallelContext.single()
    nodes_of = ranks_per_node or world_size
    if world_size > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
        rail, node = expert_node_groups([list(range(world_size))], ranks_per_node, rank) if by_node \
            else (None, None)
        ctx = ParallelContext(ParallelLayout(world_size, ep=world_size), rank=rank, dp_group=group,
                              ep_group=group, edp_group=None, tp_dp_group=group, dp_rank=rank, ep_rank=rank,
                              ep_rail_group=rail, ep_node_group=node,
                              expert_dispatch="node" if by_node else "flat", dispatch_chunks=chunks)
    plan = ShardingPlan()
    shard_parameters(holder, plan, ctx)
    materialize(holder, parameters, plan, ctx, seed=0, dtype=torch.float32)
    moe = holder.layers["1"].mlp
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y, _ = moe(x.unsqueeze(0))
        y.pow(2).mean().backward()
        times.append(time.perf_counter() - start)
    dispatcher = moe.dispatcher
    idx, _, _ = moe.router(x)  # the routing every repeat used (weights are not updated here)
    owner = idx // (MOE.num_experts // world_size)
    off_rank_copies = int((owner != rank).sum())
    off_node_copies = int((owner // nodes_of != rank // nodes_of).sum())
    row = MOE.latent_size * x.element_size()
    result = {
        "time": statistics.median(times[1:]),
        "sent_bytes": getattr(dispatcher, "bytes_sent", 0) / (repeats + 1),  # per forward
        "minimum_bytes": off_rank_copies * row,
        "hidden_bytes": off_rank_copies * D * x.element_size(),
        "across_nodes": (dispatcher.bytes_across_nodes / (repeats + 1) if by_node else off_node_copies * row),
    }
    if world_size > 1:
        keys = ("sent_bytes", "minimum_bytes", "hidden_bytes", "across_nodes")
        totals = all_reduce_sum(torch.tensor([result[k] for k in keys], dtype=torch.float64), dist.group.WORLD)
        result.update(zip(keys, totals.tolist(), strict=True))
        dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"LatentMoE d={D}, {MOE.num_experts} experts top-{MOE.top_k}, latent {MOE.latent_size}, "
          f"{args.tokens} tokens per rank, fp32, forward + backward")
    base = None
    for ep in (1, 2, 4):
        if ep == 1:
            torch.set_num_threads(1)
            r = measure(0, 1, args.tokens, args.repeats)
        else:
            r = run_distributed(measure, ep, args.tokens, args.repeats)
        base = base or r["time"]
        tokens = args.tokens * ep
        wire = (f"sent {r['sent_bytes'] / tokens:7.1f} B/token, minimum {r['minimum_bytes'] / tokens:7.1f}, "
                f"ratio {r['sent_bytes'] / r['minimum_bytes']:.2f}, hidden-width rows would be "
                f"{r['hidden_bytes'] / r['sent_bytes']:.2f}x" if ep > 1 else "no exchange")
        print(f"  ep {ep}: {r['time'] * 1e3:8.1f} ms per layer fwd+bwd ({r['time'] / base:.2f}x ep 1)  {wire}")
    flat, node = (run_distributed(measure, 4, args.tokens, args.repeats, 2, by_node) for by_node in (False, True))
    tokens = args.tokens * 4
    print(f"ep 4 as 2 nodes of 2, per token across nodes (dispatch; combine returns as many): flat "
          f"{flat['across_nodes'] / tokens:7.1f} B, by node {node['across_nodes'] / tokens:7.1f} B, ratio "
          f"{node['across_nodes'] / flat['across_nodes']:.2f}; time by node / flat {node['time'] / flat['time']:.2f} "
          f"({node['time'] * 1e3:.1f} / {flat['time'] * 1e3:.1f} ms)")
    chunked = run_distributed(measure, 4, args.tokens, args.repeats, 2, True, 2)
    print(f"ep 4 by node in 2 chunks run as a pipeline: time / 1 chunk {chunked['time'] / node['time']:.2f} "
          f"({chunked['time'] * 1e3:.1f} / {node['time'] * 1e3:.1f} ms; gloo's exchanges run on its own threads "
          f"beside the compute, on 2 shared cores)")


if __name__ == "__main__":
    main()
