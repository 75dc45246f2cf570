"""planning/host_reads.HostReads counts every kind of host read of tensor values, and names the site."""

import torch

from moe_pretrain.planning.host_reads import HostReads


def test_every_kind_of_host_read_is_counted_where_it_happens():
    x = torch.arange(6.0)
    with HostReads() as reads:
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        int(x[1])
        float(x[2])
        [0, 1][x[1].long()]
        torch.nonzero(x)
        torch.unique(x)
        x[x > 2]
        torch.repeat_interleave(x, x.long())
        torch.repeat_interleave(x, x.long(), output_size=15)  # the size given: no read
        x + 1  # no read
    assert dict(reads.by_kind) == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "__float__": 1,
                                   "__index__": 1, "nonzero": 1, "unique": 1, "boolean mask index": 1,
                                   "repeat_interleave": 1}
    assert reads.total == 10
    # This test is not in the project's packages, so the sites are '?'; a read inside them is named.
    assert {site for _, site in reads.by_site} == {"?"}
    from moe_pretrain.model.layout import DocumentLayout

    with HostReads() as reads:
        DocumentLayout.from_doc_ids(torch.zeros(2, 8, dtype=torch.long)).document_bounds  # noqa: B018
    sites = {(kind, site.split(":")[0]): n for (kind, site), n in reads.by_site.items()}
    assert sites == {("nonzero", "moe_pretrain/model/layout.py"): 1, ("tolist", "moe_pretrain/model/layout.py"): 1}
