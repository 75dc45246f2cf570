"""measured.LiveTensorBytes, which every memory test relies on, counts exactly what lives: fresh storages
from creation to death, not views or in-place results, and tensors that only autograd still holds."""

import torch

from moe_pretrain.planning.measured import LiveTensorBytes


def test_fresh_storages_are_counted_until_they_die_and_aliases_never():
    with LiveTensorBytes() as live:
        x = torch.zeros(1000)  # 4000 bytes
        assert (live.live, live.peak) == (4000, 4000)
        view, reshaped = x[:10], x.view(10, 100)
        x.add_(1.0)
        reshaped.mul_(2.0)
        assert live.live == 4000  # views and in-place results share x's storage
        y = x * 2  # a fresh 4000 bytes
        assert (live.live, live.peak) == (8000, 8000)
        del x, reshaped
        assert live.live == 8000  # `view` keeps x's storage alive
        del view
        assert live.live == 4000
        live.restart_peak()
        del y
        z = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert (live.live, live.peak) == (2000, 4000)
        del z
    assert live.live == 0


def test_what_autograd_saves_is_counted_until_backward_frees_it():
    leaf = torch.randn(256, requires_grad=True)  # made before the block: never counted
    with LiveTensorBytes() as live:
        out = leaf.exp()  # exp saves its output for backward
        loss = out.sum()
        del out
        assert live.live == 256 * 4 + 4  # out lives on in the graph, with the loss
        loss.backward()
        # The graph is freed; the loss and the leaf's new gradient remain (autograd's ones of the loss's
        # shape, and exp's grad times the output, are temporaries).
        assert live.live == 4 + 256 * 4
        del loss
        leaf.grad = None
    assert live.live == 0


def test_the_peak_is_filed_under_the_lines_of_ours_that_made_it():
    from moe_pretrain.ops.norms import rms_norm
    from moe_pretrain.planning.peak_sites import PeakSites

    x = torch.randn(64, 32)
    with PeakSites() as live:
        big = torch.zeros(100_000)  # made by a test: no line of the project's packages
        normed = rms_norm(x, torch.ones(32), 1e-6)
        del big
        small = torch.zeros(10)
    sites = dict(live.at_peak)
    assert sum(sites.values()) == live.peak == 400_000 + sum(
        size for site, size in sites.items() if site != "zeros at ?")
    assert sites["zeros at ?"] == 400_000
    assert any(site.startswith(("mul at moe_pretrain/ops/norms.py", "_to_copy at moe_pretrain/ops/norms.py"))
               for site in sites), sites
    assert normed.shape == x.shape and small.numel() == 10
