"""The dry run's compute by component (planning/compute_sites.py): a backward launch is filed under the forward
line that made its node, so a module's launches are its own whatever runs around it."""

import torch
from torch import nn

from moe_pretrain.gpus import GPUS
from moe_pretrain.model.attn_res import AttnResMix
from moe_pretrain.model.init import initialize
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.planning.compute_sites import ComputeSites
from moe_pretrain.planning.op_census import OpCensus


def filed(run, leaves: list[torch.Tensor]) -> tuple[dict[str, list], int]:
    """(launches by component, all launches) of run()'s forward, the sum of its output and their backward, the
    leaves' gradients fresh (an existing one would add a launch)."""
    for leaf in leaves:
        leaf.grad = None
    with ComputeSites() as sites, OpCensus(GPUS["h200"], sites=sites) as ops:
        run().sum().backward()
    return {name: row[0] for name, row in sites.by_component().items()}, ops.launches


def test_each_modules_forward_and_backward_launches_are_its_own_in_a_chain():
    """A norm over an AttnRes mix: each component's launches, forward and backward, are those it launches
    alone; the test's own sum (no line of the project) is filed apart; every launch is filed once."""
    gen = torch.Generator().manual_seed(0)
    mix = initialize(nn.ModuleDict({"mix": AttnResMix(16, 1e-5)}), 0)["mix"]
    with torch.no_grad():
        mix.pseudo_query.weight.normal_(generator=gen)
    norm = initialize(nn.ModuleDict({"norm": RMSNorm(16, 1e-5)}), 0)["norm"]
    bank = [torch.randn(2, 5, 16, generator=gen, requires_grad=True) for _ in range(3)]
    mixed = mix(bank).detach().requires_grad_()
    leaves = [*bank, *mix.parameters(), *norm.parameters()]
    alone_mix, _ = filed(lambda: mix(bank), leaves)
    alone_norm, _ = filed(lambda: norm(mixed), leaves)
    chained, total = filed(lambda: norm(mix(bank)), leaves)
    assert set(alone_mix) == {"AttnRes mixing", "?"} and set(alone_norm) == {"norms", "?"}
    assert alone_mix["AttnRes mixing"] > 5 and alone_norm["norms"] > 3  # forward and backward ops each
    assert chained == {"AttnRes mixing": alone_mix["AttnRes mixing"], "norms": alone_norm["norms"],
                       "?": alone_mix["?"]}
    assert sum(chained.values()) == total
