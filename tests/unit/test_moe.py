"""LatentMoE against a dense reference that loops over tokens and their experts; dispatcher edge cases."""

import pytest
import torch

from moe_pretrain.config import MoEConfig
from moe_pretrain.model.init import initialize
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher
from moe_pretrain.ops import situ_glu
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.step_reuse import reused_in_step
from moe_pretrain.training.moe_stats import combine_moe_stats
from tests.helpers import rel_rms

F64 = torch.float64


def make_moe(**overrides):
    torch.manual_seed(0)
    cfg = MoEConfig(**{"num_experts": 6, "top_k": 2, "expert_intermediate": 5, "latent_size": 4,
                       "num_shared_experts": 2, "shared_intermediate": 3, "routed_scaling": 1.5, **overrides})
    return initialize(LatentMoE(12, cfg, norm_eps=1e-5, init_std=0.5, out_std=0.5).to(F64), seed=0), cfg


@torch.no_grad()
def dense_reference(moe: LatentMoE, cfg: MoEConfig, x_TD: torch.Tensor) -> torch.Tensor:
    scores = torch.sigmoid(x_TD @ moe.router.gate.weight.T)
    experts = moe.experts
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        chosen = torch.topk(scores[t] + moe.router.expert_bias, cfg.top_k).indices.tolist()
        total = sum(float(scores[t, e]) for e in chosen)
        z = moe.latent_down.weight @ x_TD[t]
        mixed = torch.zeros(cfg.latent_size, dtype=F64)
        for e in chosen:
            h = situ_glu(experts.w_gate[e] @ z, experts.w_up[e] @ z, cfg.situ_beta, cfg.situ_linear_beta)
            mixed = mixed + (scores[t, e] / total * cfg.routed_scaling) * (experts.w_down[e] @ h)
        normed = mixed / torch.sqrt(mixed.pow(2).mean() + 1e-5) * moe.latent_norm.weight
        shared = moe.shared.down_proj.weight @ situ_glu(
            moe.shared.gate_proj.weight @ x_TD[t], moe.shared.up_proj.weight @ x_TD[t])
        out[t] = moe.latent_up.weight @ normed + shared
    return out


def test_latent_moe_matches_dense_reference():
    moe, cfg = make_moe()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.2], dtype=F64))
    x = torch.randn(3, 7, 12, dtype=F64)
    got, loss = moe(x)
    assert loss is None  # qb adds no loss term
    want = dense_reference(moe, cfg, x.reshape(-1, 12)).reshape(3, 7, 12)
    assert rel_rms(got, want) < 1e-12


def test_router_and_experts_receive_gradients():
    moe, _ = make_moe()
    x = torch.randn(10, 12, dtype=F64, requires_grad=True)
    y, _ = moe(x)
    y.pow(2).sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0  # through the combine weights
    assert x.grad is not None and moe.experts.w_down.grad.abs().sum() > 0


def test_dispatcher_all_to_one_and_empty_experts():
    dispatcher = LocalTokenDispatcher(num_experts=5)
    x = torch.randn(4, 3, dtype=F64)
    idx = torch.tensor([[3], [3], [3], [3]])
    weight = torch.full((4, 1), 0.5, dtype=F64)
    grouped, counts, meta = dispatcher.dispatch(x, idx, weight)
    assert counts.tolist() == [0, 0, 0, 4, 0]
    assert torch.equal(dispatcher.combine(grouped, meta), 0.5 * x)


def test_dispatch_combine_random_routing_matches_loop():
    gen = torch.Generator().manual_seed(1)
    dispatcher = LocalTokenDispatcher(num_experts=7)
    x = torch.randn(20, 4, generator=gen, dtype=F64)
    idx = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(20)])
    weight = torch.rand(20, 3, generator=gen, dtype=F64)
    grouped, counts, meta = dispatcher.dispatch(x, idx, weight)
    # Rows are grouped by expert in order, and a per-expert transform survives the round trip.
    scale = torch.arange(1, 8, dtype=F64).repeat_interleave(counts)
    combined = dispatcher.combine(grouped * scale[:, None], meta)
    want = torch.stack([sum(weight[t, j] * (idx[t, j] + 1) * x[t] for j in range(3)) for t in range(20)])
    assert rel_rms(combined, want) < 1e-14


def test_aux_loss_balancing_returns_a_loss():
    moe, _ = make_moe(balancing="aux_loss", aux_loss_coef=0.1)
    _, loss = moe(torch.randn(16, 12, dtype=F64))
    assert loss is not None and loss.requires_grad and 0.0 < float(loss.detach()) < 0.1 * 6


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_expert_weights_are_cast_once_per_step_under_autocast():
    """bf16 autocast: inside one reused_in_step region (a step's micro-batches) two micro-batches reuse one compute
    copy of the stacked expert weights, and their gradients equal those of a fresh cast per micro-batch
    (exactly: the same bf16 values). A write the parameter's version counter never sees (the sharded
    optimizer's, through its flat buffer) is cast afresh by the next region; outside a region every use casts."""
    moe = make_moe()[0].float()
    experts = moe.experts
    x = [torch.randn(2, 7, 12) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16), reused_in_step():
        first = experts.compute_weights()
        for xb in x:
            moe(xb)[0].float().pow(2).sum().backward()
        assert same_storage(experts.compute_weights()[0], first[0])  # the copy, each use its own node
    cached = [p.grad.clone() for p in experts.parameters()]
    moe.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not same_storage(experts.compute_weights()[0], experts.compute_weights()[0])  # fresh
        for xb in x:
            moe(xb)[0].float().pow(2).sum().backward()
    for got, expected in zip(cached, [p.grad for p in experts.parameters()]):
        assert torch.equal(got, expected)
    flat = torch.cat([p.detach().reshape(-1) for p in experts.parameters()])
    experts.w_up.data = flat[experts.w_gate.numel():experts.w_gate.numel() + experts.w_up.numel()].view_as(experts.w_up)
    version = experts.w_up._version
    flat.add_(1.0)  # the update lands on the buffer: the parameter's version counter does not move
    assert experts.w_up._version == version
    with torch.autocast("cpu", dtype=torch.bfloat16), reused_in_step():
        assert torch.equal(experts.compute_weights()[1], experts.w_up.detach().to(torch.bfloat16))
    assert experts.compute_weights()[0] is experts.w_gate  # no autocast: the parameters themselves


def test_routing_and_health_make_no_host_reads_but_one_per_step():
    """A training forward's routing records loads and health on the device (no bincount: CUDA's reads its
    input's maximum on the host), and every layer's health reaches the host in one read, whatever the
    depth. The values equal a direct computation from the routings."""
    layers = {i: make_moe()[0] for i in (1, 3, 4)}
    inputs = {i: torch.randn(14, 12, dtype=F64, generator=torch.Generator().manual_seed(i)) for i in layers}
    with HostReads() as routing_reads:
        for i, moe in layers.items():
            moe.train().router(inputs[i])
    assert routing_reads.total == 0
    for moe in layers.values():
        moe.router.record_processed(14 * 2)  # as LatentMoE.forward does after a dropless dispatch
    with HostReads() as health_reads:
        stats = combine_moe_stats({i: moe.router for i, moe in layers.items()}, 6, 6, True, None, torch.device("cpu"))
    assert health_reads.total == 1 and sorted(stats) == ["1", "3", "4"]
    for i, moe in layers.items():
        with torch.no_grad():
            idx, _, _ = moe.router(inputs[i])  # the same routing (bias unchanged)
            p = torch.sigmoid(inputs[i] @ moe.router.gate.weight.T)
        p = p / p.sum(dim=-1, keepdim=True)
        load = torch.bincount(idx.reshape(-1), minlength=6)
        assert stats[str(i)]["load"] == load.tolist() and stats[str(i)]["tokens_dropped"] == 0
        assert stats[str(i)]["load_max_over_mean"] == pytest.approx(float(load.max() / load.double().mean()))
        assert stats[str(i)]["router_entropy"] == pytest.approx(float(-(p * p.log()).sum() / 14), rel=1e-12)
    assert all(int(r.load.sum()) == 0 for r in (moe.router for moe in layers.values()))  # counters reset
