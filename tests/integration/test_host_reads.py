"""planning/host_reads.HostReads counts every kind of host read of tensor values, and names the site."""

import pytest
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


def step_reads(tmp_path, *overrides: str) -> HostReads:
    """Host reads of one training step of the TINY model (one process), after a warm-up step."""
    from moe_pretrain.training import Trainer
    from tests.models import tiny_config

    cfg = tiny_config("train.steps=2", "logging.progress=false", f"train.run_dir={tmp_path / '-'.join(overrides)}",
                      *overrides)
    trainer = Trainer(cfg)
    trainer.train_step()
    with HostReads() as reads:
        trainer.train_step()
    return reads


@pytest.mark.timeout(300)
def test_a_training_step_reads_the_host_a_fixed_number_of_times(tmp_path):
    """Per step: the step-end scalars (one tolist in the trainer) and, per micro-batch, the document layout's
    bounds (a nonzero and a tolist in model/layout.py, shared by every layer), whatever the depth and the
    number of experts; nothing inside a layer reads the host."""
    shallow = step_reads(tmp_path, "model.num_layers=3", "model.layer_pattern=KKM")
    deep = step_reads(tmp_path, "model.moe.num_experts=16")  # 6 layers
    micro = step_reads(tmp_path, "model.moe.num_experts=16", "data.micro_batches=4")
    per_step = {("tolist", "moe_pretrain/training/trainer.py")}
    per_micro_batch = {("nonzero", "moe_pretrain/model/layout.py"), ("tolist", "moe_pretrain/model/layout.py")}

    def sites(reads):
        return {(kind, site.split(":")[0]): n for (kind, site), n in reads.by_site.items()}

    assert sites(shallow) == sites(deep) == {site: 1 for site in per_step | per_micro_batch}
    assert sites(micro) == {**{site: 1 for site in per_step}, **{site: 4 for site in per_micro_batch}}
