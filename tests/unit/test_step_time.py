"""The dry run's pricing, worked by hand: the assumed routing's sends and receives, the op census's products and
launches, the links a collective crosses and what overlaps, a traced cut step scaled to its stage, and a trace
too old to price refused."""

import dataclasses
import json

import pytest
import torch

from moe_pretrain.config import load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.planning.assumed_values import AssumedValues
from moe_pretrain.planning.stage_memory import RunLayout


def test_the_assumed_routing_sends_what_each_rank_receives():
    values = AssumedValues([1.0, 3.0, 1.0, 1.0, 2.0, 0.5, 0.25, 0.25])
    idx = values.routing(10, 2, 8, device="cpu")
    assert idx.shape == (10, 2)
    assert all(len(set(row)) == 2 for row in idx.tolist())  # no token routed twice to one expert
    counts = [idx.flatten().tolist().count(e) for e in range(8)]
    assert counts == values.per_expert(20, 8) and sum(counts) == 20
    assert all(abs(n - 20 * w / sum(values.load)) < 1 for n, w in zip(counts, values.load, strict=True))
    send, receive = values.split_sizes(20, 4, 1, 8)
    assert send == [counts[0] + counts[1], counts[2] + counts[3], counts[4] + counts[5], counts[6] + counts[7]]
    assert receive == [send[1]] * 4  # every rank routes alike: each sends rank 1 what this one does
    with pytest.raises(ValueError, match="more than one copy per token"):
        AssumedValues([8.0] + [1.0] * 7).routing(10, 2, 8, device="cpu")


def test_the_op_census_counts_products_and_launches_by_their_shapes():
    from moe_pretrain.planning.op_census import OpCensus

    a = torch.randn(4, 8, requires_grad=True)
    rows = torch.randn(10, 16, dtype=torch.bfloat16)
    experts = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    with OpCensus() as ops:
        (a @ torch.randn(8, 3)).relu().sum().backward()  # mm forward and its input gradient: 2 x 2*4*8*3
        a.view(32).t()  # views launch nothing
        torch._grouped_mm(rows, experts, offs=torch.tensor([3, 7, 10], dtype=torch.int32))
    assert ops.flops_by_op == {"mm": 2 * (2 * 4 * 8 * 3), "_grouped_mm": 2 * 10 * 16 * 8}
    assert "view" not in ops.launches_by_op and "t" not in ops.launches_by_op
    assert ops.launches_by_op["mm"] == 2 and ops.launches_by_op["_grouped_mm"] == 1


def test_collectives_take_the_link_they_cross_and_only_the_optimizers_overlap():
    from moe_pretrain.config import ClusterConfig
    from moe_pretrain.gpus import GPUS
    from moe_pretrain.planning.step_time import collective_seconds, predict

    cluster = ClusterConfig(gpus_per_node=8, nvlink_gb_s=400.0, nic_gb_s=50.0)
    gb = 10**9
    # A ring all-reduce of 8 GB inside a node sends 2 x 7/8 of it over NVLink.
    assert collective_seconds("allreduce_", 8 * gb, list(range(8)), cluster) == pytest.approx(14 / 400)
    # Across nodes the NIC carries it.
    assert collective_seconds("_reduce_scatter_base_", 8 * gb, [0, 8, 16, 24], cluster) == pytest.approx(6 / 50)
    # An all-to-all over 16 ranks on 2 nodes: 7 of its 15 peers share this node (NVLink), 8 do not (NIC).
    sent = 16 * gb * 15 / 16
    assert collective_seconds("alltoall_base_", 16 * gb, list(range(16)), cluster) == pytest.approx(
        max(sent * 7 / 15 / 400e9, sent * 8 / 15 / 50e9))
    assert collective_seconds("barrier", 0, list(range(16)), cluster) == 0.0
    # The optimizer's groups hide behind the backward (2/3 of compute); the others wait in line.
    time = predict(3.0, {"dp": 1.5, "ep": 0.5, "tp": 0.25}, 989e12 * 2.0, GPUS["h200"])
    assert time.exposed_s == pytest.approx(0.75) and time.step_s == pytest.approx(3.75)
    assert predict(3.0, {"dp": 2.5}, 0.0, GPUS["h200"]).exposed_s == pytest.approx(0.5)
    assert time.mfu == pytest.approx(2.0 / 3.75)


def test_a_traced_cut_step_scales_to_the_stages_micro_batches_and_waits_out_the_bubble():
    """launch.plan --traces: a dry run of the step's first 2 micro-batches priced for the stage's 8, worked by
    hand: compute done per micro-batch and the waits for per-micro-batch collectives 4 times, compute done once
    a step and the waits for the optimizer's traffic once, then the 1F1B bubble of pp 2 (one micro-batch slot in
    8). The MFU's attention follows the traced documents: between queries that saw 40 keys and 8, each MLA
    layer's model FLOPs differ by 3 x 2 x heads x (qk + v head dims) x 32 a token."""
    from moe_pretrain.gpus import GPUS
    from moe_pretrain.planning.plan_step_time import traced_stage_step

    cfg = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml"])
    stage, gpu = dataclasses.replace(resolve_stages(cfg)[0], cp=1, recompute="none", micro_batches=8), GPUS["h200"]
    mfu = {}
    for keys in (40.0, 8.0):
        traces = [{"micro_batches": 2, "compute_s": 1.0, "compute_once_s": 0.2, "attended_keys": keys,
                   "exposed_s": {"ep": 0.5, "dp": 0.25}, "exposed_paired_s": {}, "pairs": 0},
                  {"micro_batches": 2, "compute_s": 0.5, "compute_once_s": 0.1, "attended_keys": keys,
                   "exposed_s": {}, "exposed_paired_s": {}, "pairs": 0}]
        step = traced_stage_step(cfg, RunLayout(8, 1, 2, 2), stage, traces, gpu)
        slowest = (1.0 - 0.2) * 4 + 0.2 + 0.5 * 4 + 0.25
        assert step.rank_step_s == pytest.approx([slowest, (0.5 - 0.1) * 4 + 0.1])
        assert step.step_s == pytest.approx(slowest * (1 + 1 / 8))
        assert step.days == pytest.approx(20 * step.step_s / 86400)  # ctx128: 40,960 tokens in batches of 2,048
        mfu[keys] = step.mfu
    m = cfg.model.mla
    mla_layers = sum(cfg.model.layer_kind(i) == "mla" for i in range(cfg.model.num_layers + cfg.model.mtp.layers))
    attention = mla_layers * 3 * 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 32
    per_gpu = attention * stage.batch_tokens / 8
    assert mla_layers > 0
    assert mfu[40.0] - mfu[8.0] == pytest.approx(per_gpu / (slowest * (1 + 1 / 8) * gpu.peak_flops))
    # Paired passes (parallel.overlap_micro_batches): a cut step of 4 on a stage warming up with 2 forwards ran 2
    # pairs; at 8 micro-batches it runs 6, and the same 2 warm-up forwards and 2 cool-down backwards.
    paired = {"micro_batches": 4, "compute_s": 1.0, "compute_once_s": 0.2, "attended_keys": 8.0,
              "exposed_s": {"ep": 0.5, "dp": 0.25}, "exposed_paired_s": {"ep": 0.3}, "pairs": 2}
    step = traced_stage_step(cfg, RunLayout(8, 1, 2, 2), stage, [paired], gpu)
    assert step.rank_step_s == pytest.approx([(1.0 - 0.2) * 2 + 0.2 + 0.2 + 0.3 * 3 + 0.25])


def test_a_trace_from_an_older_dry_run_is_refused_naming_its_file(tmp_path, capsys):
    """launch.plan --traces reads what traced_stage_step needs of each trace; a trace without it (made before the
    once-a-step compute was counted apart) would be priced wrong: it is refused in one line naming the file."""
    from launch import plan

    trace = {"micro_batches": 2, "compute_s": 1.0, "exposed_s": {}}
    (tmp_path / "ctx128.json").write_text(json.dumps([trace]))
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--config", "configs/smoke.yaml", "--config", "configs/stages/tiny.yaml", "--gpus", "8",
                   "--traces", str(tmp_path)])
    assert exit_.value.code == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'ctx128.json'}: a trace without attended_keys, compute_once_s" in err[0]
