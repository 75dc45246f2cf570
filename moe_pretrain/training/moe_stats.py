"""Every MoE layer's health in one record, from whichever pipeline stage holds the layer.

Each stage fills the rows of its own layers in a [num_layers, fields] float64 table (zeros elsewhere)
and one all_reduce over the pipeline group sums the tables: a fixed-size tensor collective among the
pp ranks that hold the layers, whatever the world size (no object gathering over the world per step).
Integer fields (token counts, expert loads) stay exact in float64 up to 2^53.
"""

import torch
import torch.distributed as dist

SCALARS = ("load_max", "load_min", "load_mean", "load_max_over_mean", "load_min_over_mean", "router_entropy",
           "tokens_dropped", "bias_min", "bias_max")
"""Router.pop_stats's fields, in table order; the column after them marks a row as filled (a layer this stage holds)."""
INTEGERS = {"tokens_dropped"}


def combine_moe_stats(local: dict[int, dict], num_layers: int, num_experts: int, with_loads: bool,
                      group: dist.ProcessGroup | None) -> dict[str, dict[str, float | list[int]]]:
    """{layer: stats} of every MoE layer of the model from this stage's {layer: Router.pop_stats()};
    group = the pipeline group (None: this rank holds every layer)."""
    width = len(SCALARS) + 1 + (num_experts if with_loads else 0)
    table = torch.zeros(num_layers, width, dtype=torch.float64)
    for layer, stats in local.items():
        table[layer, :len(SCALARS)] = torch.tensor([float(stats[name]) for name in SCALARS], dtype=torch.float64)
        table[layer, len(SCALARS)] = 1.0
        if with_loads:
            table[layer, len(SCALARS) + 1:] = torch.tensor(stats["load"], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(table, group=group)
    combined = {}
    for layer in torch.nonzero(table[:, len(SCALARS)]).flatten().tolist():
        row = table[layer].tolist()
        stats = {name: int(row[i]) if name in INTEGERS else row[i] for i, name in enumerate(SCALARS)}
        if with_loads:
            stats["load"] = [int(x) for x in row[len(SCALARS) + 1:]]
        combined[str(layer)] = stats
    return combined
