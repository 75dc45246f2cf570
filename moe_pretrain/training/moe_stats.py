"""Every MoE layer's health in one record, from whichever pipeline stage holds the layer.

Per step, on the device: each router's sums (expert loads, routing entropy, tokens routed, rows processed)
are stacked for all layers of this stage and summed over the balancing group in one all_reduce (the
global batch's); the derived fields (load max / min / mean and their ratios, entropy per token, dropped
rows, bias range) are computed into a [num_layers, fields] float64 table (zeros in rows of layers other
stages hold); one all_reduce over the pipeline group fills in the other stages' rows; one host read ends
it. Two collectives and one host read per step, whatever the depth. Integer fields (token counts, expert
loads) stay exact in float64 up to 2^53.
"""

import torch
import torch.distributed as dist

from moe_pretrain.model.router import Router
from parallel.collectives import all_reduce_sum

SCALARS = ("load_max", "load_min", "load_mean", "load_max_over_mean", "load_min_over_mean", "router_entropy",
           "tokens_dropped", "bias_min", "bias_max")
"""The health fields, in table order; the column after them marks a row as filled (a layer this stage holds)."""
INTEGERS = {"tokens_dropped"}


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (no tokens routed)."""
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1), 0)


def _stage_rows(routers: dict[int, Router], with_loads: bool) -> tuple[list[int], torch.Tensor]:
    """(layers, their table rows) for this stage's routers, from sums over the global batch (one collective)."""
    layers = sorted(routers)
    num_experts = routers[layers[0]].expert_bias.numel()
    # Every router of a stage reduces over the same group (parallel/parallelize.py sets their statistics).
    sums = routers[layers[0]].balancer.stats.total(torch.stack([routers[i].take_health() for i in layers]))
    load, entropy, tokens, processed = (sums[:, :num_experts], sums[:, num_experts], sums[:, num_experts + 1],
                                        sums[:, num_experts + 2])
    load_max, load_min, load_mean = load.amax(dim=1), load.amin(dim=1), load.mean(dim=1)
    bias = torch.stack([routers[i].expert_bias for i in layers]).to(torch.float64)
    columns = [load_max, load_min, load_mean, _ratio(load_max, load_mean), _ratio(load_min, load_mean),
               _ratio(entropy, tokens), load.sum(dim=1) - processed, bias.amin(dim=1), bias.amax(dim=1),
               torch.ones_like(load_mean)]
    rows = torch.stack(columns, dim=1)
    return layers, torch.cat([rows, load], dim=1) if with_loads else rows


@torch.no_grad()
def combine_moe_stats(routers: dict[int, Router], num_layers: int, num_experts: int, with_loads: bool,
                      group: dist.ProcessGroup | None, device: torch.device
                      ) -> dict[str, dict[str, float | list[int]]]:
    """{layer: stats} of every MoE layer of the model from this stage's {global layer: router} (resets their
    counters); group = the pipeline group (None: this rank holds every layer). with_loads adds every expert's
    load ("load", E integers: the report's heatmap)."""
    width = len(SCALARS) + 1 + (num_experts if with_loads else 0)
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
    if routers:
        layers, rows = _stage_rows(routers, with_loads)
        table[layers] = rows
    values = all_reduce_sum(table, group).tolist()  # the one host read
    combined = {}
    for layer, row in enumerate(values):
        if not row[len(SCALARS)]:
            continue
        stats = {name: int(row[i]) if name in INTEGERS else row[i] for i, name in enumerate(SCALARS)}
        if with_loads:
            stats["load"] = [int(x) for x in row[len(SCALARS) + 1:]]
        combined[str(layer)] = stats
    return combined
